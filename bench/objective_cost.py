"""Local training time per round of each client objective (the FedRL paper's Table 3).

    python bench/objective_cost.py                      # cnn on the embedded data, 10 clients
    python bench/objective_cost.py --rounds 5 --model lenet

Trains every client of a Dirichlet(0.5) partition for one round with each objective, from the
same received model, in one process and one thread, and reports the mean seconds per client
round and the overhead over plain cross-entropy. Writes bench/results/objective_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import client_app.local_update  # noqa: F401 - registers the objective schemas
import strategies  # noqa: F401 - registers the strategy schemas
from client_app.local_update import build_local_update
from client_app.training import train
from fedmm.config import compose, to_container
from fedmm.data import input_spec, load_dataset, load_partition
from fedmm.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--training", default="fedrl_paper")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "objective_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for objective in ("ce", "fedprox", "fedrl"):
        cfg = to_container(compose([f"objective={objective}", f"model={args.model}", f"training={args.training}",
                                    f"num_clients={args.clients}", f"clients_per_round={args.clients}", "partition.alpha=0.5"]))
        d = cfg["dataset"]
        load_dataset(d)
        times = []
        for rnd in range(1, args.rounds + 1):
            for pid in range(args.clients):
                data = load_partition(d, cfg["partition"], pid, args.clients, cfg["seed"])
                torch.manual_seed(rnd)
                model = build_model(args.model, input_spec(d))
                t = time.perf_counter()
                train(model, data, build_local_update(cfg), cfg["training"], rnd, torch.Generator().manual_seed(pid), torch.device("cpu"))
                times.append(time.perf_counter() - t)
        results[objective] = statistics.mean(times)
    base = results["ce"]
    print(f"{'objective':<10}{'s / client round':>18}{'overhead vs CE':>16}")
    for name, sec in results.items():
        print(f"{name:<10}{sec:>18.3f}{100 * (sec / base - 1):>15.1f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "training": args.training, "clients": args.clients,
                               "rounds": args.rounds, "seconds_per_client_round": results}, indent=2))


if __name__ == "__main__":
    main()
