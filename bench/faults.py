"""Fault matrix: what the app does when clients fail, misbehave or straggle.

    python bench/faults.py                      # fedavg fedmr fedcross
    python bench/faults.py --strategies fedmr   # any strategy option (e.g. fedmut clusamp scaffold feddyn)

For each strategy, one simulation (``--engine``: the in-process engine by default, or Flower's on
Ray; 10 SuperNodes, K = 5 per round, 2 rounds of 1 local epoch on the embedded data) runs one
experiment per fault, one after the other. A
bench-only ClientApp wraps the real one and injects the fault named by the experiment's output
folder:

- ``fail30``: the clients of partitions 0-2 raise (30 % of the federation);
- ``nan`` / ``inf``: partition 0 returns a model with a NaN / Inf weight;
- ``shape`` / ``dtype``: partition 0 returns a tensor of the wrong shape / dtype;
- ``count``: partition 0 reports ``num-examples = 1e30``;
- ``straggler``: partition 0 answers after the round timeout (``round_timeout=6`` in this
  experiment only; the others wait up to 300 s, so that a slow worker start is not a fault).

Each row says what happened (accepted replies per round, the rejection reasons logged, the run's
status) and "models lost": server models that went missing or non-finite (must be 0).

    python bench/faults.py --attacks            # hostile clients, the defences off and on

``--attacks`` runs, per strategy, 5 SuperNodes all in every round (K = 5) for 20 rounds of the
default local training: ``clean``; ``scale``: partition 0 sends its update × 100; ``flip``:
partition 0 sends its update × −10 (sign flipped and boosted); each attack once with the
defences off and once on (``strategy.defence.clip_update_norm`` at ``--clip`` and
``strategy.defence.robust_mean=median``). Its table is the final accuracy of each. Kill -9 +
resume, Ctrl-C + resume and a federation that never answers are covered by the test suite
(tests/test_same_results.py, tests/test_interrupt.py, tests/test_simulation.py). Writes
bench/results/faults.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FAULTS = ("fail30", "nan", "inf", "shape", "dtype", "count", "straggler")
ATTACKS = ("clean", "scale", "scale+defence", "flip", "flip+defence")


def faulty_client_app():  # noqa: ANN201
    """The real ClientApp, with the fault of the experiment (its output folder's name) injected."""
    from flwr.app import Array, Context, Message
    from flwr.clientapp import ClientApp

    from client_app import client_app as real
    from fedmm import protocol

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg = protocol.read_run_config(msg)
        fault = Path(cfg["output_dir"]).name
        pid = int(context.node_config["partition-id"])
        if fault == "fail30" and pid < 3:
            raise RuntimeError(f"injected failure on partition {pid}")
        if fault == "straggler" and pid == 0:
            time.sleep(float(cfg["round_timeout"]) + 4)
        received = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True) if fault.startswith(("scale", "flip")) else None
        reply = real.train(msg, context)
        if pid != 0 or fault == "clean":
            return reply
        if received is not None:  # a hostile client: its update scaled (× 100) or flipped (× −10)
            factor = 100.0 if fault.startswith("scale") else -10.0
            trained = protocol.record_to_model(reply.content[protocol.ARRAYS], copy=True)
            hostile = {k: (received[k] + factor * (v - received[k])).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in trained.items()}
            reply.content[protocol.ARRAYS] = protocol.model_to_record(hostile)
            return reply
        arrays = reply.content[protocol.ARRAYS]
        key = next(k for k in arrays if arrays[k].numpy().dtype.kind == "f")
        value = arrays[key].numpy().copy()
        if fault in ("nan", "inf"):
            value.flat[0] = np.nan if fault == "nan" else np.inf
            arrays[key] = Array(value)
        elif fault == "shape":
            arrays[key] = Array(value.reshape(-1)[:-1].copy())
        elif fault == "dtype":
            arrays[key] = Array(value.astype(np.float64))
        elif fault == "count":
            reply.content[protocol.METRICS][protocol.NUM_EXAMPLES] = 1e30
        return reply

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return real.query(msg, context)

    return app


def run_strategy(strategy: str, root: Path, attacks: bool = False, clip: float = 5.0, engine: str = "local") -> list[dict]:
    from flwr.serverapp import Grid, ServerApp

    from fedmm.config import compose, to_container
    from server_app.runner import run_experiment
    faults = ATTACKS if attacks else FAULTS
    if attacks:
        defence = [f"strategy.defence.clip_update_norm={clip}", "strategy.defence.robust_mean=median"]
        cfgs = [
            to_container(compose([
                f"strategy={strategy}", "num_clients=5", "clients_per_round=5", "num_rounds=20", "eval_every=20",
                "round_timeout=300", f"simulation.engine={engine}", f"output_dir={root / strategy / fault}",
                *(defence if fault.endswith("+defence") else []),
            ]))
            for fault in faults
        ]
    else:
        cfgs = [
            to_container(compose([
                f"strategy={strategy}", "num_clients=10", "clients_per_round=5", "num_rounds=2", "training.local_epochs=1",
                # a short timeout only where it is the fault: elsewhere a slow start (Ray's workers) is no failure
                f"round_timeout={6 if fault == 'straggler' else 300}", f"simulation.engine={engine}",
                f"output_dir={root / strategy / fault}",
            ]))
            for fault in faults
        ]
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context) -> None:  # noqa: ANN001
        for cfg in cfgs:
            try:
                run_experiment(grid, cfg)
            except Exception:  # noqa: BLE001 - the row records the status
                pass

    if engine == "local":
        from fedmm.local_engine import run_local_simulation

        run_local_simulation(server_app=app, client_app=faulty_client_app(), num_supernodes=cfgs[0]["num_clients"])
    else:
        from flwr.simulation import run_simulation

        from launch.cli import backend_config

        run_simulation(server_app=app, client_app=faulty_client_app(), num_supernodes=cfgs[0]["num_clients"],
                       backend_config=backend_config(cfgs[0]))
    rows = []
    for fault, cfg in zip(faults, cfgs):
        run = Path(cfg["output_dir"])
        summary = json.loads((run / "summary.json").read_text())
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        lost = 0
        if (run / "final_models.npz").exists():
            with np.load(run / "final_models.npz") as pool:
                indices = {name.split("/")[0] for name in pool.files}
                lost = cfg["clients_per_round"] - len(indices)
                lost += len({n.split("/")[0] for n in pool.files if pool[n].dtype.kind == "f" and not np.isfinite(pool[n]).all()})
        import torch

        if (run / "final_model.pt").exists():  # a run that failed (e.g. every reply rejected) wrote none
            final = torch.load(run / "final_model.pt", weights_only=True)
            lost += sum(1 for v in final.values() if v.is_floating_point() and not torch.isfinite(v).all())
        rows.append({
            "strategy": strategy, "fault": fault, "status": summary["status"],
            "replies": [m.get("replies") for m in metrics[1:]], "final_accuracy": metrics[-1]["accuracy"],
            "models_lost": lost, "largest_update_norm": max((m.get("largest_update_norm", 0.0) for m in metrics[1:]), default=0.0),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "fedmr", "fedcross"])
    parser.add_argument("--attacks", action="store_true", help="hostile clients (scale, flip) with the defences off and on")
    parser.add_argument("--clip", type=float, default=5.0, help="--attacks: strategy.defence.clip_update_norm of the defended rows")
    parser.add_argument("--engine", choices=["local", "ray"], default="local",
                        help="the simulation engine (simulation.engine): in process, or Flower's on Ray")
    parser.add_argument("--out", default=None, help="default bench/results/faults.json (--attacks: attacks.json)")
    args = parser.parse_args()
    args.out = args.out or str(Path(__file__).parent / "results" / ("attacks.json" if args.attacks else "faults.json"))
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    root = Path(tempfile.mkdtemp(prefix="fedmm-faults-"))
    rows = [row for strategy in args.strategies for row in run_strategy(strategy, root, args.attacks, args.clip, args.engine)]
    if args.attacks:
        print("| strategy | clean | scale ×100 | scale, defended | flip ×−10 | flip, defended |")
        print("|---|---|---|---|---|---|")
        for strategy in args.strategies:
            acc = {r["fault"]: (f"{r['final_accuracy']:.3f}" + ("" if r["status"] == "completed" else f" ({r['status']})"))
                   for r in rows if r["strategy"] == strategy}
            print(f"| {strategy} | " + " | ".join(acc[f] for f in ATTACKS) + " |")
        Path(args.out).write_text(json.dumps({"runs_in": str(root), "rows": rows}, indent=2))
        return
    print("| strategy | fault | status | accepted replies per round (of 5) | final accuracy | models lost |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['fault']} | {r['status']} | {', '.join(map(str, r['replies']))} | "
              f"{r['final_accuracy']:.3f} | {r['models_lost']} |")
    Path(args.out).write_text(json.dumps({"runs_in": str(root), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
