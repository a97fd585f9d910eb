"""A benchmark's results written case by case: a run cut off by a time limit keeps every case it
finished, and a case that raises is recorded with its error while the next case runs.

    log = CaseLog(out, {"machine": ..., "argv": ...}, key=("model", "clients"), resume=args.resume)
    for model in models:
        for k in clients:
            if log.finished(model=model, clients=k):      # --resume: kept from the earlier run
                continue
            with log.case(model=model, clients=k) as row:  # the row starts as its key
                row.update(measure(model, k))              # kept, and the file rewritten, at the end of the block
    log.finish()

The file is rewritten whole after every case, through a temporary file and an atomic rename,
so a kill at any instant leaves the previous complete version: ``{..header.., "rows": [...],
"errors": [{"case": {...}, "error": "..."}], "finished": false}``, ``finished`` true once the
bench reached its end. With ``resume`` an existing file's rows are kept and their cases are
not run again; its errors are dropped (those cases run again).

``FEDMM_BENCH_FAULT`` plants faults for the tests of ``bench/gpu_session.py``: a comma-separated
list of ``raise@N`` (the N-th case run by this process raises), ``overrun@N`` (the N-th case
starts a helper process and then never ends, as a step cut off by its time limit) and ``cut@N``
(the N-th case's work done, this process is killed before its row is kept: a step cut off at a
known point, without waiting for a limit). Nothing imports Flower here: ``bench/gpu_throughput.py``
uses it where only PyTorch is installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

FAULT_VARIABLE = "FEDMM_BENCH_FAULT"


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` to ``path`` whole or not at all (a temporary file beside it, renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def planted_faults() -> dict[int, str]:
    """The faults of :data:`FAULT_VARIABLE`, by the ordinal of the case they hit."""
    faults: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in os.environ.get(FAULT_VARIABLE, "").split(","))):
        kind, _, ordinal = item.partition("@")
        if kind not in ("raise", "overrun", "cut") or not ordinal.isdigit():
            raise SystemExit(f"{FAULT_VARIABLE}={os.environ[FAULT_VARIABLE]!r}: expected raise@N, overrun@N or cut@N, "
                             "comma-separated")
        faults[int(ordinal)] = kind
    return faults


def _plant(kind: str) -> None:
    if kind == "raise":
        raise RuntimeError(f"a fault planted by {FAULT_VARIABLE}")
    if kind == "cut":
        os.kill(os.getpid(), signal.SIGKILL)
    # overrun: a helper process of this one (as the bench's own workers are), then no end
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    while True:
        time.sleep(3600)


class CaseLog:
    """The cases of one benchmark run, saved to ``path`` as each one ends.

    Parameters
    ----------
    path : Path
        The JSON file (rewritten whole after every case).
    header : dict
        What the file says beside the cases (machine, settings, argv).
    key : tuple of str
        The row fields that name a case (compared by :meth:`finished` when resuming).
    resume : bool
        Keep the rows of an existing ``path`` and skip their cases.
    summary : callable, optional
        ``summary(rows) -> dict``: fields derived from the rows so far (a table, a suggestion),
        written with them every time.
    """

    def __init__(self, path: str | Path, header: dict[str, Any], key: tuple[str, ...], *, resume: bool = False,
                 summary: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None) -> None:
        self.path, self.header, self.key, self.summary = Path(path), dict(header), tuple(key), summary
        self.rows: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.kept = 0
        #: The file of the earlier run (``resume``), as read: empty otherwise.
        self.earlier: dict[str, Any] = {}
        if resume and self.path.exists():
            self.earlier = earlier = json.loads(self.path.read_text(encoding="utf-8"))
            self.rows = list(earlier.get("rows", []))
            self.kept = len(self.rows)
        self.faults = planted_faults()
        self.ran = 0
        self.finished_run = False
        self.save()

    def _key(self, fields: dict[str, Any]) -> tuple[Any, ...]:
        missing = [name for name in self.key if name not in fields]
        if missing:
            raise KeyError(f"a case of {self.path.name} needs {missing}")
        return tuple(json.dumps(fields[name], sort_keys=True, default=str) for name in self.key)

    def finished(self, **key: Any) -> bool:
        """Whether the case ``key`` has its row already (from an earlier run, with ``resume``)."""
        wanted = self._key(key)
        return any(self._key(row) == wanted for row in self.rows)

    @contextlib.contextmanager
    def case(self, **key: Any) -> Iterator[dict[str, Any]]:
        """One case: yields its row (the key's fields, to fill in); kept when the block ends
        normally, recorded as an error (the traceback's end) when it raises. Either way the file
        is rewritten and the caller goes on with the next case."""
        self._key(key)
        row: dict[str, Any] = dict(key)
        start = time.monotonic()
        try:
            yield row
            self.checkpoint()
        except Exception:  # noqa: BLE001 - the case's failure, recorded; the next case runs
            self.failed(key, traceback.format_exc(), time.monotonic() - start)
        else:
            row.setdefault("case_s", round(time.monotonic() - start, 2))
            self.add(row)

    def checkpoint(self) -> None:
        """A case's work is done (before its row is kept): where a fault is planted for this
        case (:data:`FAULT_VARIABLE`), it raises or never returns."""
        self.ran += 1
        fault = self.faults.get(self.ran)
        if fault:
            _plant(fault)

    def add(self, row: dict[str, Any]) -> None:
        """Keep a finished case's row (it holds the key's fields) and rewrite the file."""
        self._key(row)
        self.rows.append(row)
        self.save()

    def failed(self, key: dict[str, Any], error: str, seconds: float | None = None) -> None:
        """Record a case that raised (``error``: its traceback) and rewrite the file."""
        self.errors.append({"case": dict(key), "seconds": None if seconds is None else round(seconds, 2),
                            "error": error[-3000:]})
        print(f"{self.path.name}: case {key} failed:\n{error[-1500:]}", file=sys.stderr, flush=True)
        self.save()

    def rows_where(self, **fields: Any) -> list[dict[str, Any]]:
        """The kept rows whose ``fields`` have these values."""
        return [row for row in self.rows if all(row.get(name) == value for name, value in fields.items())]

    def save(self) -> None:
        document = {**self.header, "rows": self.rows, "errors": self.errors, "finished": self.finished_run,
                    "rows_from_earlier_run": self.kept}
        if self.summary is not None and self.rows:
            document.update(self.summary(self.rows))
        write_json(self.path, document)

    def finish(self, **extra: Any) -> None:
        """The bench reached its end (``extra``: fields to add to the header)."""
        self.header.update(extra)
        self.finished_run = True
        self.save()

    def exit_status(self) -> int:
        """The bench's exit status: 1 when a case failed (its error is in the file), else 0."""
        if self.errors:
            print(f"{self.path}: {len(self.errors)} case(s) failed; their errors are in the file", file=sys.stderr, flush=True)
        return 1 if self.errors else 0
