"""Scale: one simulation with many clients (default N = 1,000, K = 100 per round) on a small
model, through the app's own entry point (``launch.cli.run_job``) on the engine ``--engine`` names
(the in-process engine by default; ``ray``: Flower's). Reports whether it completes, seconds per
round, start-up time, and the peak memory of the server process and of the whole run (the server
plus every Ray process it started).

    python bench/scale.py                                    # N=1000, K=100, cnn, mnist5k iid, 1 epoch, 3 rounds
    python bench/scale.py --strategies fedmr --model lenet   # one strategy, the smaller model
    python bench/scale.py --num-clients 50 --clients-per-round 10 --rounds 1   # a quick smoke run

mnist5k has 4,000 training images, so 1,000 clients hold 4 each: ``--partition iid`` (default)
gives exactly that; ``--partition dirichlet`` needs ``--min-partition-size`` <= 4000 / N (0 lets
clients go empty).

Memory:

- server: the process that calls ``run_job`` (it runs the ServerApp and, in process, the
  ClientApps; on Ray, Flower's in-memory SuperLink state and the Ray driver). ``server peak`` is the largest resident set sampled
  after the initial evaluation (round 0: data, model, Ray and the actor pool are up; no client
  was sampled yet), ``above r0`` that peak minus the resident set at round 0, also in model sizes
  (the target is at most K + 3). ``VmHWM`` is the process's own high-water mark over its life.
- run: a background thread samples, every ``--sample-interval`` seconds, the resident set
  (RSS) and the proportional set (PSS, shared pages split among their users, e.g. Ray's
  object store and shared libraries) of the server and all its descendant processes
  (raylet, GCS, Ray workers = ClientApp actors, ...) and keeps the largest sum of each.
  The RSS sum counts shared pages once per process, so it overstates; the PSS sum does not.

Seconds per round: (seconds at the last round - seconds at round 1) / (rounds - 1) from the
run's metrics.jsonl; start-up: the wall time of ``run_job`` minus rounds x seconds per round
(with one round: minus the first round). Every strategy runs in a fresh subprocess. Prints a
table and writes bench/results/scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_overhead import ServerTimers, num_cores, per_round  # noqa: E402

from fedmm.observers import RunObserver  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MIB = 2**20


# --------------------------------------------------------------------------- /proc sampling


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set of a process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def pss_bytes(pid: int) -> int | None:
    """Proportional set of a process: 0 when it is gone, None when the kernel does not tell us."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return 0
    except OSError:  # no smaps_rollup (old kernel) or not allowed
        return None
    return 0


def status_kib(field: str, pid: int | str = "self") -> int | None:
    """A ``kB`` field of /proc/<pid>/status (VmHWM, VmRSS), in bytes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def malloc_bytes() -> dict[str, int] | None:
    """This process's C allocator, from glibc's ``mallinfo2`` (every arena): ``in_use`` (bytes
    handed out and not freed, mmapped blocks included) and ``kept`` (freed bytes the allocator
    holds in its arenas). None where there is no glibc 2.33 or later."""
    global _MALLINFO2
    if _MALLINFO2 is None:
        try:
            import ctypes

            class MallInfo2(ctypes.Structure):
                _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                             "fsmblks", "uordblks", "fordblks", "keepcost")]

            fn = ctypes.CDLL("libc.so.6").mallinfo2
            fn.restype = MallInfo2
            _MALLINFO2 = fn
        except (OSError, AttributeError):
            _MALLINFO2 = False
    if not _MALLINFO2:
        return None
    info = _MALLINFO2()
    return {"in_use": int(info.uordblks + info.hblkhd), "kept": int(info.fordblks)}


_MALLINFO2: Any = None


def memory_parts() -> dict[str, int]:
    """This process's resident set in parts: ``anon`` (its own memory), ``file`` (pages of files
    it maps: shared libraries' code, memory-mapped data), ``shmem`` (shared memory: Ray's object
    store); and, from the C allocator, ``malloc_in_use`` and ``malloc_kept`` (:func:`malloc_bytes`)."""
    parts = {"anon": status_kib("RssAnon") or 0, "file": status_kib("RssFile") or 0, "shmem": status_kib("RssShmem") or 0}
    heap = malloc_bytes()
    if heap is not None:
        parts.update(malloc_in_use=heap["in_use"], malloc_kept=heap["kept"])
    return parts


def mem_total() -> int:
    """Physical memory of the machine, in bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, from /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def label(pid: int) -> str:
    """A short name of a process: its (Ray-set) title or program name."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace").strip()
    if first.startswith("ray::"):
        return first.split()[0]
    name = os.path.basename(first.split()[0]) if first else "?"
    script = next((a.decode(errors="replace") for a in argv[1:] if a and not a.startswith(b"-")), "")
    if name.startswith("python") and script:
        name += " " + os.path.basename(script)
    return name[:60]


class Holdings:
    """Who holds model bytes in the server process, read by the sampler thread.

    ``app``: the distinct array bytes the strategy holds (its models, the global model, the
    decoded updates of the round in progress, also while ``aggregate`` works on them); ``store``: the ArrayRecord bytes of the
    messages in the engine's hands: Flower's in-memory SuperLink state (sent messages not yet
    answered, replies not yet pulled) or the in-process engine's grid (pushed messages not yet
    delivered, the copy the ClientApp in training got, replies not yet pulled). Attached by
    :class:`WatchHoldings`, an observer of the run.
    """

    def __init__(self) -> None:
        self.strategy: Any = None
        self.linkstates: list[Any] = []
        #: The in-process engine's live grids (a function: :meth:`fedmm.local_engine.LocalGrid.live`).
        self.grids: Any = list
        #: The updates ``aggregate`` is working on (the strategy hands them over from its own list).
        self.aggregating: list[Any] = []
        #: The server's resident set and its parts when round 1 is configured (after the round-0
        #: evaluation), taken in the server's own thread: the baseline "above round 0" is measured from.
        self.round0: tuple[int, dict[str, int]] | None = None

    @staticmethod
    def _arrays_bytes(models: list[Any], seen: set[int]) -> int:
        total = 0
        for model in models:
            for value in list(getattr(model, "values", lambda: [])()):
                try:
                    address = value.__array_interface__["data"][0]
                except (AttributeError, KeyError, TypeError):
                    continue
                if address not in seen:
                    seen.add(address)
                    total += int(value.nbytes)
        return total

    def app_bytes(self) -> int:
        strategy = self.strategy
        if strategy is None:
            return 0
        try:
            models = list(strategy.models or []) + [strategy.global_model or {}]
            models += [u.model for u in strategy.context.replies.accepted_updates() + list(self.aggregating)]
            return self._arrays_bytes(models, set())
        except Exception:  # noqa: BLE001 - a container changed while it was read (or an older strategy): skip
            return 0

    def client_state(self) -> tuple[int, int]:
        """The bytes the nodes' contexts keep across rounds (a stateful client method's per-client
        state: SCAFFOLD's control variate, FedDyn's gradient term), and how many nodes keep any;
        the in-process engine only (on Ray the state lives in Flower's node state)."""
        total = nodes = 0
        for grid in list(self.grids()):
            try:
                held = grid.state_bytes()
            except (AttributeError, RuntimeError):  # an older engine, or its table changed while read
                continue
            total, nodes = total + sum(held.values()), nodes + len(held)
        return total, nodes

    def store_bytes(self) -> int:
        total = 0
        for grid in list(self.grids()):
            try:
                held = grid.held_messages()
            except RuntimeError:  # the grid's table changed while it was read: skip it this time
                held = []
            messages = held + list(grid.delivering)
            for msg in messages:
                try:
                    if msg.has_content():
                        total += sum(r.count_bytes() for r in msg.content.array_records.values())
                except Exception:  # noqa: BLE001 - a message being mutated: skip it
                    continue
        for linkstate in list(self.linkstates):
            for name in ("message_ins_store", "message_res_store"):
                try:
                    messages = list(getattr(linkstate, name, {}).values())
                except RuntimeError:
                    continue
                for msg in messages:
                    try:
                        if msg.has_content():
                            total += sum(r.count_bytes() for r in msg.content.array_records.values())
                    except Exception:  # noqa: BLE001 - a message being mutated: skip it
                        continue
        return total


class WatchHoldings(RunObserver):
    """Lets ``holdings`` see the run, as an observer of it: the strategy (from its start), the
    updates its method aggregates (while it does), the moment round 1 starts (after the round-0
    evaluation); and the engine's messages: the in-process engine's live grids
    (:meth:`fedmm.local_engine.LocalGrid.live`, with the copies the ClientApp holds), or Flower's
    link state on Ray (its class's constructor wrapped: Flower's, not this app's)."""

    def __init__(self, holdings: Holdings, ray_engine: bool = True) -> None:
        self.holdings = holdings
        if ray_engine:
            from flwr.server.superlink.linkstate import in_memory_linkstate

            init = in_memory_linkstate.InMemoryLinkState.__init__

            def init_and_watch(state: Any, *args: Any, **kwargs: Any) -> None:
                init(state, *args, **kwargs)
                holdings.linkstates.append(state)

            in_memory_linkstate.InMemoryLinkState.__init__ = init_and_watch
        else:
            from fedmm.local_engine import LocalGrid

            holdings.grids = LocalGrid.live  # read when the sampler counts

    def on_strategy_start(self, strategy: Any) -> None:
        self.holdings.strategy = strategy

    def on_phase(self, server_round: int, phase: str, seconds: float) -> None:
        if server_round == 0 and phase == "evaluate" and self.holdings.round0 is None:
            self.holdings.round0 = (rss_bytes(), memory_parts())
        if phase == "aggregate":  # the round's end is over: the method holds the updates no more
            self.holdings.aggregating = []

    def on_aggregate(self, server_round: int, updates: Any) -> None:
        self.holdings.aggregating = list(updates)


class TreeSampler(threading.Thread):
    """Sample the memory of this process and its descendants until :meth:`stop`."""

    def __init__(self, interval: float, metrics_file: Path, holdings: Holdings | None = None) -> None:
        super().__init__(daemon=True)
        self.holdings = holdings
        self.peak_app = self.peak_store = 0
        #: The nodes' kept state (bytes, nodes keeping any) at the latest sample: :meth:`Holdings.client_state`.
        self.client_state = (0, 0)
        self.at_server_peak: dict[str, int] = {}
        self.at_live_peak: dict[str, int] = {}
        self.server_rss_r0_parts: dict[str, int] | None = None
        self.interval = interval
        self.metrics_file = metrics_file
        self.root = os.getpid()
        self._halt = threading.Event()
        self.samples = 0
        self.peak_rss_sum = 0
        self.peak_pss_sum = 0
        self.pss_available = True
        self.peak_processes = 0
        self.server_rss_r0: int | None = None
        self.server_peak_after_r0 = 0
        self.server_peak = 0
        self.per_process: dict[int, dict[str, Any]] = {}

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)
        self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def sample(self) -> None:
        self.samples += 1
        pids = descendants(self.root)
        rss_sum = pss_sum = 0
        for pid in pids:
            rss = rss_bytes(pid)
            rss_sum += rss
            pss = pss_bytes(pid) if self.pss_available else None
            if pss is None:
                self.pss_available = False
            else:
                pss_sum += pss
            entry = self.per_process.setdefault(pid, {"name": "?", "peak_rss": -1})
            if rss > entry["peak_rss"]:
                # Ray renames its workers (ray::ClientAppActor) after start: name them at their peak.
                entry["peak_rss"], entry["name"] = rss, label(pid)
        self.peak_rss_sum = max(self.peak_rss_sum, rss_sum)
        self.peak_pss_sum = max(self.peak_pss_sum, pss_sum)
        self.peak_processes = max(self.peak_processes, len(pids))
        server = rss_bytes(self.root)
        self.server_peak = max(self.server_peak, server)
        if self.server_rss_r0 is None and self.holdings is not None and self.holdings.round0 is not None:
            self.server_rss_r0, self.server_rss_r0_parts = self.holdings.round0
        if self.server_rss_r0 is None:
            try:
                if self.metrics_file.stat().st_size > 0:  # round 0 is evaluated
                    self.server_rss_r0 = server
                    self.server_rss_r0_parts = memory_parts()
            except OSError:
                pass
        else:
            app = self.holdings.app_bytes() if self.holdings else 0
            store = self.holdings.store_bytes() if self.holdings else 0
            self.peak_app, self.peak_store = max(self.peak_app, app), max(self.peak_store, store)
            self.client_state = self.holdings.client_state() if self.holdings else (0, 0)
            if server >= self.server_peak_after_r0:
                # RssAnon: the process's own heap; RssShmem: shared memory it maps (Ray's object
                # store, /dev/shm), counted in its RSS for the pages it touched
                self.at_server_peak = {"rss": server, "app": app, "store": store, "client_state": self.client_state[0],
                                       **memory_parts()}
            self.server_peak_after_r0 = max(self.server_peak_after_r0, server)
            heap = malloc_bytes()
            if heap is not None and heap["in_use"] >= self.at_live_peak.get("malloc_in_use", 0):
                # the most the C allocator held live at once: who held it
                self.at_live_peak = {"malloc_in_use": heap["in_use"], "app": app, "store": store, "where": self.main_stack()}

    def main_stack(self, depth: int = 6) -> str:
        """Where the server's main thread is now: its innermost frames of the app's own code."""
        import traceback

        frame = sys._current_frames().get(threading.main_thread().ident)
        if frame is None:
            return ""
        root = str(Path(__file__).resolve().parent.parent)
        own = [f for f in traceback.extract_stack(frame) if f.filename.startswith(root) and "/.venv/" not in f.filename
               and not f.filename.endswith("scale.py")]
        return " < ".join(f"{Path(f.filename).relative_to(root)}:{f.lineno} {f.name}" for f in reversed(own[-depth:]))

    def top(self, count: int = 8) -> list[dict[str, Any]]:
        rows = sorted(self.per_process.values(), key=lambda e: -e["peak_rss"])[:count]
        return [{"name": e["name"], "peak_rss_mib": e["peak_rss"] / MIB} for e in rows]


def rest_parts(sampler: TreeSampler, model_bytes: int) -> dict[str, float]:
    """The rest at the server's peak (above round 0, less the strategy's arrays and the engine's
    messages) split by :func:`memory_parts`, in model sizes; {} without glibc's ``mallinfo2``."""
    peak, r0 = sampler.at_server_peak, sampler.server_rss_r0_parts or {}
    if "malloc_in_use" not in peak or "malloc_in_use" not in r0:
        return {}
    delta = {key: peak[key] - r0.get(key, 0) for key in ("anon", "file", "shmem", "malloc_in_use", "malloc_kept")}
    held = peak.get("app", 0) + peak.get("store", 0) + peak.get("client_state", 0)
    return {
        "rest_malloc_kept_models": delta["malloc_kept"] / model_bytes,
        "rest_file_pages_models": delta["file"] / model_bytes,
        "rest_outside_malloc_models": (delta["anon"] - delta["malloc_in_use"] - delta["malloc_kept"]) / model_bytes,
        "rest_live_unheld_models": (delta["malloc_in_use"] - held) / model_bytes,
        "rest_shmem_models": delta["shmem"] / model_bytes,
    }


def live_peak_parts(sampler: TreeSampler, model_bytes: int) -> dict[str, float]:
    """The most the C allocator held live at once after round 0 (above its round-0 level), and who
    held it then: the strategy's arrays, the engine's messages, and the other live allocations;
    in model sizes. {} without glibc's ``mallinfo2``."""
    peak, r0 = sampler.at_live_peak, sampler.server_rss_r0_parts or {}
    if "malloc_in_use" not in peak or "malloc_in_use" not in r0:
        return {}
    above = peak["malloc_in_use"] - r0["malloc_in_use"]
    return {"live_peak_above_r0_models": above / model_bytes, "live_peak_app_models": peak["app"] / model_bytes,
            "live_peak_store_models": peak["store"] / model_bytes,
            "live_peak_other_models": (above - peak["app"] - peak["store"]) / model_bytes, "live_peak_where": peak.get("where", "")}


# --------------------------------------------------------------------------- one run


def child_scale(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the simulation in this process while sampling memory."""
    ray_engine = spec["cfg"]["simulation"]["engine"] == "ray"
    if ray_engine:
        import flwr.simulation  # noqa: F401 - imported before the clock starts
    import torch  # noqa: F401

    import client_app.client_app  # noqa: F401
    from launch.cli import run_job
    from fedmm.models import build_model
    from fedmm.results import METRICS_FILE, read_metrics

    cfg = spec["cfg"]
    d = cfg["dataset"]
    try:
        from fedmm.data import input_spec

        model = build_model(cfg["model"]["name"], input_spec(d))
    except ImportError:  # an older layout of the app (measured for comparison)
        model = build_model(cfg["model"]["name"], int(d["in_channels"]), int(d["num_classes"]), int(d["image_size"]))
    model_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    del model
    timers = ServerTimers()
    holdings = Holdings()
    watching = WatchHoldings(holdings, ray_engine)
    run_dir = Path(cfg["output_dir"])
    sampler = TreeSampler(float(spec["interval"]), run_dir / METRICS_FILE, holdings)
    baseline = rss_bytes()
    sampler.start()
    start = time.perf_counter()
    try:
        run_job(cfg, observers=[timers, watching])
    finally:
        wall = time.perf_counter() - start
        sampler.stop()
    rows = read_metrics(run_dir)
    seconds = {int(r["round"]): float(r["seconds"]) for r in rows}
    rounds, k = int(cfg["num_rounds"]), int(cfg["clients_per_round"])
    pr = per_round(seconds, rounds)
    first = seconds[1] - seconds.get(0, 0.0)
    r0 = sampler.server_rss_r0 or baseline
    above = max(sampler.server_peak_after_r0 - r0, 0)
    return {
        "run_dir": str(run_dir),
        "completed": len(rows) == rounds + 1 and int(rows[-1]["round"]) == rounds,
        "final_accuracy": rows[-1]["accuracy"],
        "replies_last_round": rows[-1].get("replies"),
        "wall_s": wall,
        "seconds": seconds,
        "per_round_s": pr,
        "first_round_s": first,
        "startup_s": wall - (rounds * pr if pr is not None else first),
        "select_round_1_s": timers.seconds["select"].get(1, 0.0),
        "breakdown_per_round_s": timers.per_round(rounds, int(spec["parallel"])),
        "server_timers": timers.as_json(),
        "model_bytes": model_bytes,
        "server_rss_before_run_mib": baseline / MIB,
        "server_rss_round0_mib": r0 / MIB,
        "server_peak_after_round0_mib": sampler.server_peak_after_r0 / MIB,
        "server_above_round0_mib": above / MIB,
        "server_above_round0_models": above / model_bytes,
        "server_target_models": k + 3,
        "server_vmhwm_mib": (status_kib("VmHWM") or 0) / MIB,
        # who holds model bytes (distinct arrays): each one's own peak, and both at the server's peak
        "app_peak_models": sampler.peak_app / model_bytes,
        "store_peak_models": sampler.peak_store / model_bytes,
        "at_server_peak_app_models": sampler.at_server_peak.get("app", 0) / model_bytes,
        "at_server_peak_store_models": sampler.at_server_peak.get("store", 0) / model_bytes,
        "at_server_peak_rest_models": (above - sampler.at_server_peak.get("app", 0) - sampler.at_server_peak.get("store", 0)
                                       - sampler.at_server_peak.get("client_state", 0)) / model_bytes,
        # what the nodes keep across rounds (in process, in the server's memory): at the server's
        # peak and at the run's end, and per node that keeps any, in model sizes
        "at_server_peak_client_state_models": sampler.at_server_peak.get("client_state", 0) / model_bytes,
        "client_state_end_models": sampler.client_state[0] / model_bytes,
        "client_state_nodes": sampler.client_state[1],
        "client_state_per_node_models": sampler.client_state[0] / model_bytes / max(sampler.client_state[1], 1),
        # the server's peak above round 0 split into its own heap and the shared memory it maps
        "at_server_peak_anon_above_r0_models": (sampler.at_server_peak.get("anon", 0)
                                                - (sampler.server_rss_r0_parts or {}).get("anon", 0)) / model_bytes,
        "at_server_peak_shmem_above_r0_models": (sampler.at_server_peak.get("shmem", 0)
                                                 - (sampler.server_rss_r0_parts or {}).get("shmem", 0)) / model_bytes,
        # the rest (neither the strategy's nor the engine's messages) in parts, each above round 0:
        # the allocator's freed bytes it keeps, the pages of mapped files, the process's memory outside
        # the C allocator (Python's small-object arenas, thread stacks), and what is left: live C
        # allocations no one above holds (the clients' training and the central evaluation in process:
        # torch's tensors; numpy temporaries; Python objects of 512 bytes or more)
        **rest_parts(sampler, model_bytes),
        **live_peak_parts(sampler, model_bytes),
        "tree_peak_rss_sum_mib": sampler.peak_rss_sum / MIB,
        "tree_peak_pss_sum_mib": sampler.peak_pss_sum / MIB if sampler.pss_available else None,
        "tree_peak_processes": sampler.peak_processes,
        "top_processes": sampler.top(),
        "samples": sampler.samples,
    }


# --------------------------------------------------------------------------- driver


def write_synthetic_cifar(folder: Path, num_train: int, num_test: int = 100) -> Path:
    """Random 32x32 RGB images with 10 labels, as a ``DatasetDict.save_to_disk`` folder."""
    import datasets
    import numpy as np
    from PIL import Image

    if (folder / "dataset_dict.json").exists():
        return folder
    rng = np.random.default_rng(0)
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    splits = {}
    for split, n in (("train", num_train), ("test", num_test)):
        images = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
        splits[split] = datasets.Dataset.from_dict(
            {"img": [Image.fromarray(a) for a in images], "label": (np.arange(n) % 10).tolist()}, features=features)
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    return folder


def compose_cfg(args: argparse.Namespace, strategy: str, output_dir: Path) -> dict[str, Any]:
    from fedmm import config as config_mod

    overrides = [f"strategy={strategy}", f"num_clients={args.num_clients}", f"clients_per_round={args.clients_per_round}",
                 f"num_rounds={args.rounds}", f"seed={args.seed}", f"model={args.model}", f"partition={args.partition}",
                 f"training.local_epochs={args.local_epochs}", f"simulation.engine={args.engine}", f"output_dir={output_dir}"]
    if args.engine == "ray":
        overrides.append(f"simulation.client_cpus={args.client_cpus}")
    if args.partition == "dirichlet":
        overrides += [f"partition.alpha={args.alpha}", f"partition.min_partition_size={args.min_partition_size}"]
    overrides += args.override
    return config_mod.to_container(config_mod.compose(overrides))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "fedmr", "fedcross"])
    parser.add_argument("--num-clients", type=int, default=1000)
    parser.add_argument("--clients-per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="cnn", help="cnn (6.3 MiB) or lenet (0.17 MiB)")
    parser.add_argument("--partition", default="iid", choices=["iid", "dirichlet"])
    parser.add_argument("--alpha", type=float, default=0.5, help="dirichlet only")
    parser.add_argument("--min-partition-size", type=int, default=0, help="dirichlet only; at most 4000 / num-clients")
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--engine", choices=["local", "ray"], default="local",
                        help="simulation.engine: the in-process engine, or Flower's on Ray")
    parser.add_argument("--client-cpus", type=float, default=1.0, help="--engine ray: simulation.client_cpus")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-interval", type=float, default=0.25, help="seconds between memory samples")
    parser.add_argument("--synthetic-cifar", type=int, default=0, metavar="N",
                        help="train on N random CIFAR-shaped images (32x32x3, written once to the workdir as a "
                             "Hugging Face save_to_disk folder, loaded with dataset=cifar10 dataset.path=...): vgg16 "
                             "needs 32x32 inputs and CIFAR itself needs the internet")
    parser.add_argument("--override", nargs="*", default=[], help="further hydra overrides")
    parser.add_argument("--workdir", default=None, help="where runs and logs go (default: a new temporary folder)")
    parser.add_argument("--verbose", action="store_true", help="show the children's output")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "scale.json"))
    parser.add_argument("--child", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        _, workdir = args.child
        spec = json.loads((Path(workdir) / "spec.json").read_text())
        (Path(workdir) / "result.json").write_text(json.dumps(child_scale(spec)))
        return

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fedmm-scale-")).resolve()
    if args.synthetic_cifar:
        folder = write_synthetic_cifar(workdir / "synthetic-cifar", args.synthetic_cifar)
        args.override = ["dataset=cifar10", f"dataset.path={folder}"] + args.override
    cores = num_cores()
    parallel = max(1, int(cores // args.client_cpus)) if args.engine == "ray" else 1
    print(f"scale: {cores} cores ({parallel} ClientApps at a time), runs and logs in {workdir}", flush=True)
    print(f"{'strategy':<10}{'N':>6}{'K':>5}{'model':>7}{'done':>6}{'s/round':>9}{'startup s':>11}{'1st round s':>12}"
          f"{'roster s':>10}{'server r0':>11}{'peak':>8}{'above r0':>10}{'copies':>8}{'/K+3':>6}{'run RSS':>9}{'run PSS':>9}"
          f"   (MiB)", flush=True)
    rows = []
    for strategy in args.strategies:
        cfg = compose_cfg(args, strategy, workdir / strategy / "run")
        res = run_child_scale(cfg, parallel, args, workdir / strategy)
        row = dict(res, strategy=strategy, num_clients=args.num_clients, clients_per_round=args.clients_per_round,
                   model=args.model, partition=args.partition, rounds=args.rounds, local_epochs=args.local_epochs,
                   engine=args.engine, client_cpus=args.client_cpus if args.engine == "ray" else None, parallel=parallel)
        rows.append(row)
        pr = f"{row['per_round_s']:.2f}" if row["per_round_s"] is not None else "n/a"
        pss = f"{row['tree_peak_pss_sum_mib']:.0f}" if row["tree_peak_pss_sum_mib"] is not None else "n/a"
        print(f"{strategy:<10}{args.num_clients:>6}{args.clients_per_round:>5}{args.model:>7}{'yes' if row['completed'] else 'NO':>6}"
              f"{pr:>9}{row['startup_s']:>11.1f}{row['first_round_s']:>12.1f}{row['select_round_1_s']:>10.1f}"
              f"{row['server_rss_round0_mib']:>11.0f}{row['server_peak_after_round0_mib']:>8.0f}{row['server_above_round0_mib']:>10.0f}"
              f"{row['server_above_round0_models']:>8.1f}{row['server_target_models']:>6}{row['tree_peak_rss_sum_mib']:>9.0f}{pss:>9}",
              flush=True)
        b = row.get("breakdown_per_round_s")
        if b:
            print(f"{'':<10}per round: select {b['select']:.2f}s, configure {b['configure']:.2f}s, exchange {b['exchange']:.2f}s "
                  f"(clients' own training {b['client_train_sum']:.2f}s summed, /{parallel} parallel), aggregate "
                  f"{b['aggregate']:.2f}s, evaluate {b['evaluate']:.2f}s", flush=True)
        print(f"{'':<10}model copies at the server's peak: strategy {row['at_server_peak_app_models']:.1f}, the engine's "
              f"messages {row['at_server_peak_store_models']:.1f}, the rest {row['at_server_peak_rest_models']:.1f} (each one's own "
              f"peak: strategy {row['app_peak_models']:.1f}, store {row['store_peak_models']:.1f}); above round 0 at that "
              f"peak: heap {row['at_server_peak_anon_above_r0_models']:.1f}, shared memory (Ray's object store) "
              f"{row['at_server_peak_shmem_above_r0_models']:.1f}", flush=True)
        if "live_peak_above_r0_models" in row:
            print(f"{'':<10}the most held live at once (C allocator, above round 0): {row['live_peak_above_r0_models']:.1f} = "
                  f"strategy {row['live_peak_app_models']:.1f} + the engine's messages {row['live_peak_store_models']:.1f} + "
                  f"other {row['live_peak_other_models']:.1f}; the server then at {row['live_peak_where']}", flush=True)
        if "rest_live_unheld_models" in row:
            print(f"{'':<10}the rest at that peak: live allocations no one above holds {row['rest_live_unheld_models']:.1f}, "
                  f"freed and kept by the allocator {row['rest_malloc_kept_models']:.1f}, pages of mapped files "
                  f"{row['rest_file_pages_models']:.1f}, outside the allocator {row['rest_outside_malloc_models']:.1f}, shared "
                  f"memory {row['rest_shmem_models']:.1f}", flush=True)
        if row["client_state_nodes"]:
            print(f"{'':<10}the nodes' kept state: {row['client_state_end_models']:.1f} model sizes at the end over "
                  f"{row['client_state_nodes']} nodes ({row['client_state_per_node_models']:.2f} per node), "
                  f"{row['at_server_peak_client_state_models']:.1f} at the server's peak", flush=True)
        top = ", ".join(f"{p['name']} {p['peak_rss_mib']:.0f}" for p in row["top_processes"][:6])
        print(f"{'':<10}largest processes (peak RSS MiB): {top}", flush=True)
    print("server r0: server RSS at the round-0 evaluation; peak: its largest sampled RSS after that; copies: (peak - r0) / "
          "model size, against the target K + 3; run RSS / PSS: largest sampled sum over the server and its descendants.")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "cpus": cores,
               "python": platform.python_version(), "memory_gib": mem_total() / 2**30}
    out.write_text(json.dumps({"machine": machine, "argv": sys.argv[1:], "workdir": str(workdir), "rows": rows}, indent=2))
    print(f"wrote {out}")


def run_child_scale(cfg: dict[str, Any], parallel: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One run in a fresh interpreter (this file with ``--child``)."""
    import subprocess

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(json.dumps({"cfg": cfg, "parallel": parallel, "interval": args.sample_interval}))
    log_path = workdir / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "scale", str(workdir)],
                              stdout=None if args.verbose else log, stderr=None if args.verbose else subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "" if args.verbose else "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"scale: the {cfg['strategy']['name']} run failed (exit {proc.returncode}); log: {log_path}\n{tail}")
    result = json.loads((workdir / "result.json").read_text())
    result["seconds"] = {int(r): v for r, v in result["seconds"].items()}
    return result


if __name__ == "__main__":
    main()
