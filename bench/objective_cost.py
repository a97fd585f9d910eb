"""Local training time per round of each client objective (the FedRL paper's Table 3).

    python bench/objective_cost.py                      # cnn on the embedded data, 10 clients
    python bench/objective_cost.py --rounds 5 --model lenet --methods fedavg fedprox moon

Trains every client of a Dirichlet(0.5) partition for one round with each method's client
objective, from the same received model, in one process and one thread, and reports the mean
seconds per client round and the overhead over plain cross-entropy. The methods run interleaved
(for each round and client, every method in turn), so that a machine whose load changes during
the run slows them alike. Each gets what its client sees from round 2 on: SCAFFOLD a control
variate, FedGen a generator, MOON its previous local model (kept per client from the bench's
first round, which is not timed). Writes bench/results/objective_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import strategies  # noqa: E402,F401 - registers the strategy schemas
from objectives.base import build_local_update  # noqa: E402
from client_app.training import train  # noqa: E402
from fedmm.config import compose, to_container  # noqa: E402
from fedmm.data import input_spec, load_dataset, load_partition  # noqa: E402
from fedmm.models import model_for  # noqa: E402

from client_content import content_for  # noqa: E402 - bench/client_content.py

#: method (strategy preset) -> its client objective's label
METHODS = {"fedavg": "CE (FedAvg)", "fedprox": "FedProx", "fedrl": "FedRL", "scaffold": "SCAFFOLD", "moon": "MOON",
           "fedgen": "FedGen", "fedasam": "FedASAM", "fedsam": "FedSAM"}


def main() -> None:
    from flwr.app import RecordDict

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--clients", type=int, default=10, help="clients trained (partitions 0 .. clients-1)")
    parser.add_argument("--partitions", type=int, default=None,
                        help="partitions the data is split into (default: --clients); more partitions, smaller clients")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (after one untimed round)")
    parser.add_argument("--training", default="fedrl_paper")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "objective_cost.json"))
    args = parser.parse_args()
    partitions = args.clients if args.partitions is None else args.partitions
    if partitions < args.clients:
        parser.error(f"--partitions {partitions} is fewer than --clients {args.clients} (each trained client is a partition)")
    torch.set_num_threads(1)
    cfgs = {m: to_container(compose([f"strategy={m}", f"model={args.model}", f"training={args.training}",
                                     f"num_clients={partitions}", f"clients_per_round={args.clients}", "partition.alpha=0.5"]))
            for m in args.methods}
    d = next(iter(cfgs.values()))["dataset"]
    load_dataset(d)
    states = {m: [RecordDict() for _ in range(args.clients)] for m in args.methods}
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    for rnd in range(0, args.rounds + 1):  # round 0: untimed (MOON's previous models, warm-up)
        for pid in range(args.clients):
            for method in args.methods:
                cfg = cfgs[method]
                data = load_partition(d, cfg["partition"], pid, partitions, cfg["seed"])
                torch.manual_seed(rnd)
                model = model_for(cfg, input_spec(d))
                content = content_for(cfg, model)
                update = build_local_update(cfg, states[method][pid], content)
                update.node = pid
                t = time.perf_counter()
                train(model, data, update, update.run.training, rnd + 1, torch.Generator().manual_seed(pid), torch.device("cpu"))
                update.end(model)
                if rnd > 0:
                    times[method].append(time.perf_counter() - t)
    results = {m: statistics.mean(v) for m, v in times.items()}
    base = results.get("fedavg", next(iter(results.values())))
    print(f"{'method':<14}{'s / client round':>18}{'overhead vs CE':>16}")
    for name, sec in results.items():
        print(f"{METHODS[name]:<14}{sec:>18.3f}{100 * (sec / base - 1):>15.1f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "training": args.training, "clients": args.clients, "partitions": partitions,
                               "rounds": args.rounds, "seconds_per_client_round": results}, indent=2))


if __name__ == "__main__":
    main()
