"""The price of differential privacy: final accuracy against ε for FedAvg, FedMR and FedCross.

    .venv/bin/python bench/privacy_price.py [--methods fedavg fedmr fedcross] [--epsilons 1 4 8 inf]
        [--seeds 0 1 2] [--federations 100:10:dirichlet 1000:100:iid] [--rounds 50] [--clip 0.1] [--out ...]
        [--groups G]

For each federation N:K (N clients of the embedded data, K drawn per round), each ε (at
δ = 1/N) and each seed, one run of each method with ``strategy.context.privacy``: C = ``--clip``, the
noise multiplier z the budget allows over ``--rounds`` rounds (:func:`strategies.privacy.noise_multiplier_for`,
the accountant the run itself uses); ε = inf is the run without differential privacy. Every run:
the small LeNet (its 62k parameters keep the noise's norm, z·2C/m·√d on a mean, smallest),
two local epochs at lr 0.05 (the defaults of ``--lr`` and ``--local-epochs``). Writes the rows (final accuracy, ε reached, z) and
``--figure`` (accuracy against ε, one panel per federation, mean and range over the seeds).

``--groups G``: the multi-model methods (FedMR, FedCross) release G group means a round
(``strategy.privacy.groups=G``, docs/privacy.md "Grouped releases"), their rows named
``fedmr_grouped`` / ``fedcross_grouped`` with ``groups``; at ε = inf (no differential privacy, so
no groups) they run as the plain method, or with ``--noiseless`` clipped and grouped with z = 1e-9
(rows marked ``noiseless``: their ε holds nothing; they measure what grouping and clipping cost
without the noise). FedAvg's runs are the same with or without it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


#: The methods a ``--groups`` run releases group means for (they release their models).
GROUPED = ("fedmr", "fedcross")


def label(method: str, groups: int | None) -> str:
    """A row's method: ``fedmr_grouped`` when its releases are grouped."""
    return f"{method}_grouped" if groups and method in GROUPED else method


#: The noise multiplier of a ``--noiseless`` run: clipped and grouped, no privacy to speak of.
NOISELESS_Z = 1e-9


def run_one(method: str, n: int, k: int, partition: str, epsilon: float, seed: int, rounds: int, clip: float, root: Path,
            training: tuple[str, ...], groups: int | None = None, noiseless: bool = False) -> dict:
    from fedmm.config import compose, to_container
    from fedmm.results import read_metrics
    from launch.cli import run_job
    from strategies.privacy import noise_multiplier_for

    delta = 1.0 / n
    private = math.isfinite(epsilon)
    z = noise_multiplier_for(epsilon, delta, rounds, k, n) if private else None
    dp = [f"strategy.privacy.clip_norm={clip}", f"strategy.privacy.noise_multiplier={z}",
          f"strategy.privacy.delta={delta}"] if private else []
    grouped = groups if (private or noiseless) and method in GROUPED else None
    if noiseless and grouped and not private:  # the grouped method's arithmetic and clipping, without the noise
        z = NOISELESS_Z
        dp = [f"strategy.privacy.clip_norm={clip}", f"strategy.privacy.noise_multiplier={z}",
              f"strategy.privacy.delta={delta}"]
    dp += [f"strategy.privacy.groups={grouped}"] if grouped else []
    name = f"{label(method, groups)}_N{n}_eps{epsilon:g}_s{seed}"
    run = run_job(to_container(compose([f"strategy={method}", "model=lenet", f"num_clients={n}", f"clients_per_round={k}",
                                        f"partition={partition}", f"num_rounds={rounds}", *training, f"seed={seed}",
                                        f"eval_every={rounds}", *dp, f"output_dir={root / name}"])))
    rows = read_metrics(run)
    summary = json.loads((run / "summary.json").read_text())
    return {"method": label(method, groups), "groups": grouped, "N": n, "K": k, "partition": partition, "epsilon_target": epsilon, "seed": seed, "noise_multiplier": z,
            "epsilon": summary.get("privacy", {}).get("epsilon"), "final_accuracy": rows[-1]["accuracy"],
            "status": summary["status"], "clipped_share": statistics.mean(r.get("dp_clipped_share", 0.0) for r in rows[1:]),
            "update_norm_median": statistics.mean(r.get("dp_update_norm_median", 0.0) for r in rows[1:]),
            "seconds": rows[-1].get("seconds"),
            **({"noiseless": "z = 1e-9: clipped and grouped without noise; its ε holds nothing"} if z == NOISELESS_Z else {})}


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    federations = sorted({(r["N"], r["K"]) for r in rows})
    fig, axes = plt.subplots(1, len(federations), figsize=(5 * len(federations), 3.6), squeeze=False)
    for ax, (n, k) in zip(axes[0], federations):
        for method, groups in sorted({(r["method"], r.get("groups") or 0) for r in rows}):
            mine = [r for r in rows if r["N"] == n and r["method"] == method and (r.get("groups") or 0) == groups]
            eps = sorted({r["epsilon_target"] for r in mine})
            if not eps:
                continue
            finite = [x for x in eps if math.isfinite(x)] or [1.0]
            xs = [e if math.isfinite(e) else 2 * max(finite) for e in eps]
            accs = [[r["final_accuracy"] for r in mine if r["epsilon_target"] == e] for e in eps]
            ax.errorbar(xs, [statistics.mean(a) for a in accs],
                        yerr=[[statistics.mean(a) - min(a) for a in accs], [max(a) - statistics.mean(a) for a in accs]],
                        marker="o", capsize=3, label=f"{method} (G = {groups})" if groups else method)
            ax.set_xticks(xs, [f"{e:g}" if math.isfinite(e) else "∞" for e in eps])
        ax.set_title(f"N = {n}, K = {k}, δ = 1/N")
        ax.set_xlabel("ε")
        ax.set_ylabel("final accuracy")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["fedavg", "fedmr", "fedcross"])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 4.0, 8.0, math.inf])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--federations", nargs="+", default=["100:10:dirichlet", "1000:100:iid"],
                        help="N:K:partition (1,000 clients of the embedded data: iid, every Dirichlet draw leaves one short)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--clip", type=float, default=0.1, help="C (about the median update norm of these runs)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--out", default="bench/results/privacy_price.json")
    parser.add_argument("--figure", default="docs/results/privacy_price.png")
    parser.add_argument("--groups", type=int, default=None,
                        help="G: FedMR and FedCross release G group means a round (strategy.privacy.groups)")
    parser.add_argument("--noiseless", action="store_true",
                        help="with --groups, ε = inf runs the grouped methods clipped and grouped with z = 1e-9 (no "
                             "privacy: the cost of grouping and clipping alone) instead of as the plain method")
    args = parser.parse_args()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    root = Path(tempfile.mkdtemp(prefix="fedmm-privacy-"))
    out = Path(args.out)
    rows: list[dict] = json.loads(out.read_text())["rows"] if out.is_file() else []
    done = {(r["method"], r["N"], r["epsilon_target"], r["seed"], r.get("groups")) for r in rows}
    methods = [label(m, args.groups) for m in args.methods]
    training = (f"training.lr={args.lr}", f"training.local_epochs={args.local_epochs}")
    for fed in args.federations:
        n_text, k_text, partition = fed.split(":")
        n, k = int(n_text), int(k_text)
        for seed in args.seeds:
            for epsilon in args.epsilons:
                for method in args.methods:
                    grouped = args.groups if (math.isfinite(epsilon) or args.noiseless) and method in GROUPED else None
                    if (label(method, args.groups), n, epsilon, seed, grouped) in done:
                        continue
                    rows.append(run_one(method, n, k, partition, epsilon, seed, args.rounds, args.clip, root, training,
                                        args.groups, args.noiseless))
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps({"rounds": args.rounds, "clip": args.clip, "rows": rows}, indent=1,
                                              default=lambda v: None if isinstance(v, float) and not math.isfinite(v) else v))
    print("| N:K:partition | method | " + " | ".join(f"ε={e:g}" for e in args.epsilons) + " |")
    print("|---|---|" + "---|" * len(args.epsilons))
    for fed in args.federations:
        n = int(fed.split(":")[0])
        for method in methods:
            cells = []
            for e in args.epsilons:
                accs = [r["final_accuracy"] for r in rows if r["N"] == n and r["method"] == method and r["epsilon_target"] == e
                        and r.get("groups") in (None, args.groups)]
                cells.append(f"{statistics.mean(accs):.3f} ({min(accs):.3f}-{max(accs):.3f})" if accs else "–")
            print(f"| {fed} | {method} | " + " | ".join(cells) + " |")
    figure(rows, Path(args.figure))
    print(f"wrote {out} and {args.figure}")


if __name__ == "__main__":
    main()
