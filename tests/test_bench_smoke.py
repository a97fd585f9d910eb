"""The benches that train clients without a server run against the current client API: a bench
that falls behind a refactor fails here, not in front of a user timing the project."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> None:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_phases_of_a_simulated_process_from_its_marks() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("e2e_overhead", ROOT / "bench" / "e2e_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    marks = {"spawn": 100.0, "imports": 103.0, "ray_init_start": 103.5, "ray_init_end": 106.0, "server_main": 108.0,
             "strategy_start": 110.0, "round_1_end": 115.0, "round_2_end": 117.0, "round_3_end": 119.0, "exit": 122.0}
    p = bench.phases(marks, 3)
    assert p == {"process": 22.0, "imports": 3.0, "ray_init": 2.5, "to_server_main": 5.0, "server_setup": 2.0,
                 "round_1": 5.0, "rounds_2_to_last": 4.0, "after_last_round": 3.0, "startup": 13.0}
    # Flower's run_simulation: the ServerApp starts while Ray starts; the segments still add up
    flower = dict(marks, server_main=103.2, ray_init_start=103.4, ray_init_end=109.0)
    p = bench.phases(flower, 3)
    assert p["to_server_main"] == pytest.approx(0.2) and p["server_setup"] == pytest.approx(6.8) and p["ray_init"] == pytest.approx(5.6)
    assert sum(p[k] for k in ("imports", "to_server_main", "server_setup", "round_1", "rounds_2_to_last",
                              "after_last_round")) == pytest.approx(p["process"])


def test_the_scale_bench_counts_what_the_strategy_holds_also_while_it_aggregates() -> None:
    """bench/scale.py's ``Holdings``: distinct array bytes of the pool, the global model, the
    round's decoded updates, and the updates ``aggregate`` works on (handed over from the
    strategy's own list: before, they counted as "the rest" at the aggregation peak)."""
    import importlib.util
    from types import SimpleNamespace

    import numpy as np

    spec = importlib.util.spec_from_file_location("scale_bench", ROOT / "bench" / "scale.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    one = lambda: {"w": np.zeros(250, np.float32)}  # noqa: E731 - 1,000 bytes
    pool = [one(), one()]
    replies = [SimpleNamespace(model=one()), SimpleNamespace(model=one())]
    seen_in_aggregate = []

    class Strategy:
        models, global_model = pool, pool[0]  # the global model shares the pool's bytes
        context = SimpleNamespace(replies=SimpleNamespace(accepted_updates=lambda: []))  # the reply ledger: nothing accepted yet

        def aggregate(self, server_round, updates):
            seen_in_aggregate.append(holdings.app_bytes())
            return updates[0].model

    from flwr.server.superlink.linkstate import in_memory_linkstate

    holdings = bench.Holdings()
    strategy = Strategy()
    init = in_memory_linkstate.InMemoryLinkState.__init__  # WatchHoldings wraps Flower's link state: undone below
    try:
        watching = bench.WatchHoldings(holdings)  # an observer of the run, as run_job hands it the events
        watching.on_strategy_start(strategy)
        assert holdings.app_bytes() == 2_000
        watching.on_aggregate(1, replies)  # the round's end hands the method the updates
        strategy.aggregate(1, replies)
        watching.on_phase(1, "aggregate", 0.0)  # the round's end is over
    finally:
        in_memory_linkstate.InMemoryLinkState.__init__ = init
    assert seen_in_aggregate == [4_000] and holdings.app_bytes() == 2_000


def test_the_objective_cost_bench_runs_the_stateful_objectives(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    _run(["bench/objective_cost.py", "--clients", "2", "--partitions", "20", "--rounds", "1", "--methods", "fedavg", "scaffold", "fedgen",
          "--model", "lenet", "--training", "default", "--out", str(out)])
    assert out.is_file() and json.loads(out.read_text())


def test_the_vectorized_throughput_bench_trains_both_paths_to_the_same_weights(tmp_path: Path) -> None:
    out = tmp_path / "vec.json"
    _run(["bench/vectorized_throughput.py", "--models", "lenet", "--clients", "3", "--batch-sizes", "8",
          "--samples-per-client", "20", "--repeats", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["clients"] == 3 and row["sequential_clients_per_s"] > 0 and row["vectorized_clients_per_s"] > 0
    assert row["max_weight_diff"] < 1e-5  # the same training, one computation


def test_the_vmap_convolution_bench_trains_the_own_batch_clients_as_the_sequential_loop(tmp_path: Path) -> None:
    """bench/vmap_conv.py's own-batch vmap is the sequential loop's training (its figure is worth
    reading only then); the shared-batch one is timed beside it."""
    out = tmp_path / "vmap.json"
    _run(["bench/vmap_conv.py", "--shapes", "mnist", "--clients", "3", "--batch-sizes", "4", "--steps", "2",
          "--repeats", "1", "--unfold", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["clients"] == 3 and row["sequential_s"] > 0 and row["vmap_shared_batch_s"] > 0
    assert row["own_batches_max_weight_diff"] < 1e-5 and row["unfolded_max_weight_diff"] < 1e-5


def test_the_runners_of_a_strategy_run_interleaved_and_pair_run_by_run(tmp_path: Path, monkeypatch) -> None:
    """bench/e2e_overhead.py: with --repeats the runners take turns (A B A B ...), so a drift
    of the machine's speed falls on both, and run i of one is divided by run i of the other."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("e2e_overhead", ROOT / "bench" / "e2e_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    order: list[tuple[str, str]] = []
    clock = iter(range(100))

    def once(kind: str, spec: dict, workdir: Path, verbose: bool) -> dict:
        order.append((kind, workdir.name))
        start = 10.0 * next(clock)
        process = {"plain": 10.0, "flower": 11.0}[kind] * (1 + len(order) / 10)  # the machine slows down
        marks = {"spawn": start, "imports": start + 1, "strategy_start": start + 2, "round_1_end": start + 3,
                 "round_2_end": start + 4, "exit": start + process}
        return {"marks": marks, "seconds": {}, "accuracy": {}}

    monkeypatch.setattr(bench, "_run_child_once", once)
    cfg = {"num_rounds": 2}
    plain, app = bench.run_children([("plain", {"cfg": cfg}, tmp_path / "plain"), ("flower", {"cfg": cfg}, tmp_path / "app")],
                                    verbose=False, repeats=3)
    assert order == [("plain", "plain"), ("flower", "app"), ("plain", "repeat1"), ("flower", "repeat1"),
                     ("plain", "repeat2"), ("flower", "repeat2")]
    pair = bench.paired_ratio(app, plain)
    ratios = [11.0 * (1 + (2 * i + 2) / 10) / (10.0 * (1 + (2 * i + 1) / 10)) for i in range(3)]
    assert pair["pairs"] == 3 and pair["median"] == pytest.approx(sorted(ratios)[1])
    assert pair["min"] == pytest.approx(min(ratios)) and pair["max"] == pytest.approx(max(ratios))
    assert bench.paired_ratio(app, {"phases_runs": plain["phases_runs"][:1]}) is None


def test_the_scale_bench_splits_the_rest_by_the_allocator_and_the_mapped_files() -> None:
    """bench/scale.py: the rest above round 0 (neither the strategy's arrays nor the engine's
    messages) in parts that add up to it: the allocator's freed bytes it keeps, mapped files'
    pages, memory outside the allocator, live allocations no one above holds; and the most the
    allocator held live at once, split by who held it."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("scale_bench", ROOT / "bench" / "scale.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r0 = {"anon": 1000, "file": 300, "shmem": 0, "malloc_in_use": 800, "malloc_kept": 50}
    peak = {"rss": 2600, "app": 400, "store": 100, "anon": 2200, "file": 400, "shmem": 0, "malloc_in_use": 1500,
            "malloc_kept": 550}
    sampler = SimpleNamespace(at_server_peak=peak, server_rss_r0_parts=r0,
                              at_live_peak={"malloc_in_use": 1800, "app": 500, "store": 200, "where": "x.py:1 f"})
    above = (peak["anon"] + peak["file"]) - (r0["anon"] + r0["file"])  # 1,300 bytes above round 0
    parts = bench.rest_parts(sampler, model_bytes=100)
    assert parts == {"rest_malloc_kept_models": 5.0, "rest_file_pages_models": 1.0, "rest_outside_malloc_models": 0.0,
                     "rest_live_unheld_models": 2.0, "rest_shmem_models": 0.0}
    rest = (above - peak["app"] - peak["store"]) / 100
    assert sum(v for k, v in parts.items()) == pytest.approx(rest)
    live = bench.live_peak_parts(sampler, model_bytes=100)
    assert live == {"live_peak_above_r0_models": 10.0, "live_peak_app_models": 5.0, "live_peak_store_models": 2.0,
                    "live_peak_other_models": 3.0, "live_peak_where": "x.py:1 f"}
    assert bench.rest_parts(SimpleNamespace(at_server_peak={"app": 1}, server_rss_r0_parts={}), 100) == {}


def test_the_run_config_blob_bench_measures_the_message_the_runner_sends() -> None:
    """bench/run_config_blob.py: the blob's bytes are the difference it makes to a train message
    (plus its framing), the named values carry the same settings, and a cold read gives the
    server's settings back."""
    import importlib.util

    from fedmm import protocol
    from fedmm.config import client_run, compose

    spec = importlib.util.spec_from_file_location("run_config_blob", ROOT / "bench" / "run_config_blob.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.measure("default", [], repeat=1)
    framing = row["message_bytes_blob"] - row["message_bytes_without"] - row["json_bytes"]
    assert 0 < framing < 64, row
    cfg = compose([]).to_dict()
    named = bench.flattened(cfg)
    assert named["training.lr"] == cfg["training"]["lr"] and len(named) == row["named_values"]
    assert client_run(protocol.run_config_record(cfg)).to_dict() == cfg


def test_the_field_table_shows_a_failed_run_as_failed_and_pairs_the_gaps_seed_by_seed(tmp_path: Path) -> None:
    """bench/field_attacks.py --table: a run that stopped without a final model is a "failed" cell
    (not dropped, not a number), and each gap is the mean of the seed-by-seed differences."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("field_attacks", ROOT / "bench" / "field_attacks.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def row(fault: str, acc: float, status: str = "completed") -> dict:
        return {"fault": fault, "final_accuracy": acc, "status": status}

    for seed, (clean, absent, alie) in enumerate([(0.80, 0.70, 0.69), (0.60, 0.50, 0.53)]):
        rows = [row("clean+defence", clean), row("absent-1+defence", absent), row("alie-1+defence", alie)]
        (tmp_path / f"fedavg_default_s{seed}.json").write_text(
            json.dumps({"method": "fedavg", "defence": "default", "seed": seed, "rows": rows}))
    (tmp_path / "fedavg_none_s0.json").write_text(json.dumps({"method": "fedavg", "defence": "none", "seed": 0, "rows": [
        row("clean", 0.8), row("absent-1", 0.7), row("alie-1", 0.083, "failed")]}))
    text = bench.table(tmp_path, ["none", "default"])
    line = next(line for line in text.splitlines() if line.startswith("| fedavg | alie | 1 |"))
    assert line == "| fedavg | alie | 1 | failed n=1 | 0.610 (-9.0, **+1.0**) n=2 |", line


def test_the_field_goal_counts_the_cells_within_two_points_per_method_and_defence(tmp_path: Path) -> None:
    """bench/field_attacks.py --goal: per defence and hostile count, the attacks whose mean paired
    gap to the federation without the hostile nodes is at least −2 points, of those measured."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("field_attacks", ROOT / "bench" / "field_attacks.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def row(fault: str, acc: float) -> dict:
        return {"fault": fault, "final_accuracy": acc, "status": "completed"}

    rows = [row("clean+defence", 0.8), row("absent-1+defence", 0.70), row("alie-1+defence", 0.681),
            row("tunedalie-1+defence", 0.67), row("absent-2+defence", 0.6), row("ipm-2+defence", 0.65)]
    (tmp_path / "fedmr_trust_s0.json").write_text(json.dumps({"method": "fedmr", "defence": "trust", "seed": 0, "rows": rows}))
    lines = bench.goal(tmp_path, ["trust"]).splitlines()
    assert lines[2] == "| trust | 1 | 1/2 (n=1) | 1/2 |" and lines[3] == "| trust | 2 | 1/1 (n=1) | 1/1 |", lines
    table = bench.table(tmp_path, ["trust"])  # the optimized attacks of byzfl's search are the untuned rows
    assert "| fedmr | optalie (untuned) | 1 | – |" in table and "| fedmr | tunedalie | 1 | 0.670 (-13.0, -3.0) n=1 |" in table
