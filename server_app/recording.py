"""Where a run writes, and how: the run directory, metrics lines, JSON files, plots.

See :mod:`fedmm.results` for the files of a run directory. Every write either completes or
leaves the previous content: a metrics line is appended with one ``write`` of the whole line
and flushed to disk; JSON files are written to a temporary file and renamed. ``metrics.jsonl``
is always written; ``metrics.csv`` and the TensorBoard events are trackers of the run folder
(:class:`CsvTracker`, :class:`TensorBoardTracker`), driven by :class:`RunRecorder` with the
others that ``tracking.loggers`` names (:mod:`server_app.tracking`: MLflow, W&B).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from logging import WARNING
from pathlib import Path
from typing import IO, Any

import yaml
from flwr.supercore import log

from fedmm.errors import ConfigError
from fedmm.observers import RunObserver
from fedmm.results import CONFIG_FILE, METRICS_FILE, json_safe
from server_app.tracking import BACKENDS, FINAL_FILES, RunInfo, Tracker, round_scalars


def run_dir_name(run: Any, simulation: bool = True) -> str:
    """``<timestamp>_<strategy>[+objective]_<dataset>_<partition>_s<seed>`` in simulation;
    ``<timestamp>_<strategy>[+objective]_<dataset>_deployment_s<seed>`` in deployment, where
    each SuperNode trains on its own data and the config's partition is not used."""
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    objective = run.objective.name
    method = run.strategy.name + ("" if objective == "ce" else f"+{objective}")
    split = run.partition.name if simulation else "deployment"
    return f"{stamp}_{method}_{run.dataset.name}_{split}_s{run.seed}"


def _ours_before_start(entry: Path) -> bool:
    """What may be in a run directory before the run starts: hydra's job files (``.hydra/``,
    the job's log), a lock or a previous attempt's files that hold no result (a run that
    stopped before its first metrics line)."""
    return entry.name in (".hydra", "config.yaml", "summary.json", ".fedmm.lock") or entry.suffix == ".log"


def create_run_dir(run: Any, simulation: bool = True) -> Path:
    """Create the run's directory (absolute). Never reuses a directory that holds a run.

    Without ``output_dir`` it is a new folder under ``results_root`` named by
    :func:`run_dir_name` (``simulation``: as there)."""
    if run.output_dir:
        path = Path(os.path.expanduser(str(run.output_dir))).resolve()
        if (path / METRICS_FILE).exists():
            raise ConfigError("output_dir", str(path), "a directory that does not already hold a run's metrics.jsonl (to continue that run: resume=<dir>)")
        if path.exists() and not path.is_dir():
            raise ConfigError("output_dir", str(path), "a directory (this is a file)")
        foreign = sorted(p.name for p in path.iterdir() if not _ours_before_start(p)) if path.is_dir() else []
        if foreign:
            raise ConfigError("output_dir", str(path), f"a new or empty directory (it holds {foreign[0]!r}"
                              f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}: a run writes and replaces files there)")
        path.mkdir(parents=True, exist_ok=True)
        return path
    root = Path(os.path.expanduser(str(run.results_root))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    base = run_dir_name(run, simulation)
    for attempt in range(1000):
        path = root / (base if attempt == 0 else f"{base}-{attempt}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a fresh run directory under {root}")


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w", previous: Path | None = None) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path``; on success flush it to disk and rename it over
    ``path`` (then sync the folder), so ``path`` is always the old content or the whole new one.

    ``previous``: the old ``path`` is kept there (one older generation), moved only once the new
    content is complete on disk: the older generation is never lost before the newer one exists."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if previous is not None and path.exists():
            _keep_as(path, previous)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)


def _keep_as(path: Path, previous: Path) -> None:
    """``previous`` becomes ``path``'s current content, atomically, ``path`` staying in place
    (a hard link renamed over ``previous``); where the filesystem has no hard links, ``path`` is
    renamed (it is then missing until its replacement is renamed in, a moment later)."""
    link = previous.with_name(f".{previous.name}-{os.getpid()}.link")
    try:
        link.unlink(missing_ok=True)
        os.link(path, link)
    except OSError:
        os.replace(path, previous)
        return
    os.replace(link, previous)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` as a whole."""
    with atomic_file(path) as f:
        f.write(text)


LOCK_FILE = ".fedmm.lock"


class RunLock:
    """An exclusive lock on a run directory for as long as a run uses it.

    ``flock`` on ``.fedmm.lock``: the kernel releases it when the process ends in any way
    (even SIGKILL), so a stale lock never blocks a resume. A second run given the same directory
    (``output_dir`` or ``resume``) while the first one runs is refused with a ConfigError.
    """

    def __init__(self, path: Path) -> None:
        import fcntl

        self.path = path / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            raise ConfigError("output_dir", str(path), f"a directory no other run is using (in use by {holder})") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)

    def release(self) -> None:
        """Give the directory back (the lock file stays; the lock is what counts)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class TensorBoardTracker(Tracker):
    """``<run dir>/tensorboard``: the rows' numbers (``global/<key>``, ``federated/<key>``); view
    with ``tensorboard --logdir <run dir>``."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._writer: Any = None

    def on_metrics(self, row: Mapping[str, Any]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        step = int(row["round"])
        for key, value in round_scalars(row).items():
            self._writer.add_scalar(key.replace("_", "/", 1) if key.startswith("federated_") else f"global/{key}", value, step)
        self._writer.flush()

    def on_run_end(self, status: str, reason: str, files: Sequence[Path]) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class CsvTracker(Tracker):
    """``<run dir>/metrics.csv``: the rows of ``metrics.jsonl`` as a table (every column any row
    has), rewritten after each round."""

    name = "csv"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.rows: list[dict[str, Any]] = []

    def on_restore(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self.rows = [dict(row) for row in rows]

    def on_metrics(self, row: Mapping[str, Any]) -> None:
        import csv
        import io

        self.rows.append(dict(row))
        columns: list[str] = []
        for r in self.rows:
            columns += [k for k in r if k not in columns]
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        for r in self.rows:
            writer.writerow({k: ("" if v is None else v) for k, v in json_safe(r).items()})
        write_atomic(self.run_dir / "metrics.csv", out.getvalue())


def build_trackers(tracking: Any, run_dir: Path) -> list[Tracker]:
    """The trackers ``tracking.loggers`` names (:class:`fedmm.config.TrackingSettings`), in its order."""
    own = {TensorBoardTracker.name: TensorBoardTracker, CsvTracker.name: CsvTracker}
    return [own[name](run_dir) if name in own else BACKENDS[name](getattr(tracking, name)) for name in tracking.loggers]


class RunRecorder(RunObserver):
    """Writes the files of one run as it goes (``metrics.jsonl``: the record) and drives its
    trackers (:mod:`server_app.tracking`): an observer of the run (:mod:`fedmm.observers`).

    ``history`` holds the metrics rows so far; ``federated`` the federated-evaluation metrics
    by round. Both are part of a checkpoint, and :meth:`restore` puts them back on resume.
    ``trackers``: what follows the run besides ``metrics.jsonl`` (default: TensorBoard and CSV).
    A tracker that fails after :meth:`on_run_start` is dropped with one warning; the run goes on.
    """

    def __init__(self, path: Path, run: Mapping[str, Any], trackers: Sequence[Tracker] | None = None) -> None:
        self.path = path
        self.history: list[dict[str, Any]] = []
        self.federated: dict[int, dict[str, float]] = {}
        self.trackers: list[Tracker] = list(trackers) if trackers is not None else [TensorBoardTracker(path), CsvTracker(path)]
        write_atomic(path / CONFIG_FILE, yaml.safe_dump(run.to_dict() if hasattr(run, "to_dict") else dict(run), sort_keys=False))

    def on_run_start(self, info: RunInfo) -> None:
        """Start every tracker; an error (a store that does not open) fails the run before its first round."""
        for index, tracker in enumerate(self.trackers):
            try:
                tracker.on_run_start(info)
            except BaseException:
                del self.trackers[index:]  # not started: nothing to end
                raise

    def restore(self, history: list[dict[str, Any]], federated: Mapping[int, Mapping[str, float]]) -> None:
        """Continue from a checkpoint: ``metrics.jsonl`` is rewritten to exactly its rows (a
        row written after the checkpoint, by the run that was stopped, is dropped); the trackers get them."""
        self.history = [dict(row) for row in history]
        self.federated = {int(r): dict(m) for r, m in federated.items()}
        write_atomic(self.path / METRICS_FILE, "".join(json.dumps(json_safe(row)) + "\n" for row in self.history))
        self._each("on_restore", self.history)

    def on_metrics(self, row: Mapping[str, Any]) -> None:
        """Append one evaluated round to ``metrics.jsonl`` (one write of the whole line, synced),
        then hand it to the trackers (``metrics.csv``, TensorBoard, ...)."""
        self.history.append(dict(row))
        line = (json.dumps(json_safe(dict(row))) + "\n").encode("utf-8")
        fd = os.open(self.path / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._each("on_metrics", dict(row))

    def on_run_end(self, status: str, reason: str, files: Sequence[Path]) -> None:
        """End the trackers with the run's status (``summary.json``'s) and its final files."""
        self._each("on_run_end", status, reason, files)
        self.trackers = []

    def final_files(self) -> list[Path]:
        """The run's final files that exist (:data:`~server_app.tracking.FINAL_FILES`): call it
        after ``summary.json`` and the plot are written."""
        return [self.path / name for name in FINAL_FILES if (self.path / name).is_file()]

    def close(self, status: str = "completed", reason: str = "") -> None:
        """:meth:`on_run_end` with :meth:`final_files`."""
        self.on_run_end(status, reason, self.final_files())

    def _each(self, call: str, *args: Any) -> None:
        """``call`` on every tracker; one that raises is dropped with a warning (the run goes on:
        ``metrics.jsonl`` is the record)."""
        for tracker in list(self.trackers):
            try:
                getattr(tracker, call)(*args)
            except Exception as err:  # noqa: BLE001 - a tracker never ends the run
                self.trackers.remove(tracker)
                log(WARNING, "fedmm: the %s tracker failed (%s: %s); the run goes on without it (metrics.jsonl holds "
                    "every round)", tracker.name, type(err).__name__, err)

    def write_json(self, name: str, data: Any) -> None:
        """Write ``data`` as ``name`` (JSON, non-finite numbers as null), atomically."""
        write_atomic(self.path / name, json.dumps(json_safe(data), indent=2))

    def plot_learning_curve(self, title: str) -> Path:
        """``learning_curve.png``: test accuracy and loss of the global model per round."""
        # Figure + Agg canvas directly: no pyplot (its import and global state), works headless.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        out = self.path / "learning_curve.png"
        rounds = [row["round"] for row in self.history]
        fig = Figure(figsize=(10, 4))
        FigureCanvasAgg(fig)
        ax_acc, ax_loss = fig.subplots(1, 2)
        ax_acc.plot(rounds, [100 * row["accuracy"] for row in self.history], marker=".", label="global model, test split")
        federated = [(row["round"], row["federated_accuracy"]) for row in self.history if row.get("federated_accuracy") is not None]
        if federated:
            ax_acc.plot([r for r, _ in federated], [100 * a for _, a in federated], marker="x", linestyle="--",
                        label="federated (clients' held-out rows)")
            ax_acc.legend(fontsize=8)
        ax_acc.set_xlabel("round")
        ax_acc.set_ylabel("test accuracy (%)")
        ax_acc.grid(alpha=0.3)
        ax_loss.plot(rounds, [row["loss"] for row in self.history], marker=".", color="tab:red")
        federated_loss = [(row["round"], row["federated_loss"]) for row in self.history if row.get("federated_loss") is not None]
        if federated_loss:
            ax_loss.plot([r for r, _ in federated_loss], [v for _, v in federated_loss], marker="x", linestyle="--", color="tab:orange")
        ax_loss.set_xlabel("round")
        ax_loss.set_ylabel("test loss")
        ax_loss.grid(alpha=0.3)
        from matplotlib.ticker import MaxNLocator

        for ax in (ax_acc, ax_loss):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
        fig.suptitle(title)
        fig.tight_layout()
        with atomic_file(Path(out), "wb") as f:
            fig.savefig(f, dpi=100, format="png")
        return out
