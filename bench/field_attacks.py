"""The field's attacks against each defence, as the Byzantine-robustness literature measures them.

    .venv/bin/python bench/field_attacks.py [--methods fedavg fedmr fedcross scaffold] [--seeds 0 1 2]
        [--defences none nnm bucketing default trust] [--attacks alie ... absent] [--rounds 8]
        [--out-dir bench/results/field]
    .venv/bin/python bench/field_attacks.py --table [--out-dir bench/results/field]    # no runs: the table
    .venv/bin/python bench/field_attacks.py --goal [--out-dir bench/results/field]     # no runs: the goal's count

For each method, defence and seed, one simulation of bench/faults.py's attack experiments (10
nodes all in every round, Dir(0.5) on the embedded data, one local epoch, ``--rounds`` rounds):
the clean run, the federation without the hostile nodes (``absent``), and each attack with one and
two hostile nodes of ten: byzfl's ALIE, IPM, Mimic and the optimized ALIE and IPM (colluding,
omniscient: computed from the honest updates of the same round; the optimized ones search their
factor against the aggregator chain only: the "untuned" rows), the tuned ALIE, IPM and Mimic
(bench/faults.py ``TUNED``: their factor, or whom Mimic copies, searched against the whole
defence the round applies, screens and trust included) and label flipping. The defences:

- ``none``: no defence;
- ``nnm``: byzfl's nearest-neighbour mixing, then its trimmed mean, f = 2 (Allouah et al. 2023);
- ``bucketing``: byzfl's bucketing (s = 2), then its trimmed mean, f = 2 (Karimireddy et al. 2022);
- ``trust``: the trust stage, FLTrust's rule against a root set of 100 rows of the test split
  (``strategy.defence.trust_root=100``, the preset ``+strategy/defence=trust``);
- ``default``: the preset each method gets (``+strategy/defence=<preset>``, :data:`DEFAULTS`): the
  stage of screens and adaptive clipping, and for FedMR and FedCross the norm screen with refill
  (bench/faults.py ``default_defence`` composes to the same settings: tests/test_aggregators.py).

``nnm`` and ``bucketing`` replace the mean a method takes; FedMR and FedCross keep a model per node
and take no mean of their updates (only their evaluated global model would change), so they are
measured with ``none`` and ``default`` only.

Each (method, defence, seed) writes one JSON file (resumable: the experiments of ``--attacks``
a file lacks are run, with the clean run when it lacks that, and merged into it).
``--table`` prints, per method, attack and hostile count, the final accuracy (mean over the seeds
present) of each defence, with the paired gap (seed by seed) to the clean run and to the run
without the hostile nodes of the same defence.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: The field's attacks, the tuned ones and label flipping; ``absent``: the federation without the
#: hostile nodes. ``optalie`` and ``optipm`` are the untuned rows: their factor searched by byzfl
#: against the aggregator chain only (the plain mean when the defence is a stage).
ATTACKS = ("alie", "ipm", "mimic", "optalie", "optipm", "tunedalie", "tunedipm", "tunedmimic", "labelflip", "absent")
#: How the table names an attack.
LABELS = {"optalie": "optalie (untuned)", "optipm": "optipm (untuned)"}
#: The preset each method's ``default`` defence is (conf/strategy/defence/).
DEFAULTS = {"fedavg": "one_model", "scaffold": "one_model", "fedmr": "per_model", "fedcross": "per_model"}


#: The trust stage: FLTrust's rule against a root set of 100 rows of the test split (the paper's size).
TRUST = ("strategy.defence.trust_root=100",)
#: byzfl's chains measured beside the default (methods that take a mean only).
CHAINS = {
    "nnm": ("strategy.defence.pre_aggregators=[nnm]", "strategy.defence.aggregator=trmean", "strategy.defence.f=2"),
    "bucketing": ("strategy.defence.pre_aggregators=[bucketing]", "strategy.defence.aggregator=trmean",
                  "strategy.defence.f=2"),
}


def defence_overrides(method: str, defence: str) -> tuple[str, ...]:
    if defence == "default":
        return (f"+strategy/defence={DEFAULTS[method]}",)
    if defence == "trust":
        return TRUST
    if defence in CHAINS:
        return CHAINS[defence]
    raise ValueError(f"--defences: {defence!r} is none of none, default, trust, {', '.join(CHAINS)}")


def run(method: str, defence: str, seed: int, rounds: int, out: Path, attacks: tuple[str, ...] = ATTACKS) -> None:
    """The experiments of ``attacks`` (with one and two hostile nodes) not yet in ``out``, and the
    clean run when it is not; merged into ``out``, written after each batch."""
    import faults

    old = json.loads(out.read_text())["rows"] if out.exists() else []
    done = {r["fault"].removesuffix("+defence") for r in old}
    todo = tuple(a for a in attacks if any(f"{a}-{n}" not in done for n in (1, 2)))
    if not todo and "clean" in done:
        return
    root = Path(tempfile.mkdtemp(prefix="fedmm-field-"))
    arms = ("",) if defence == "none" else ("+defence",)
    rows = faults.run_strategy(method, root, todo, (1, 2), () if defence == "none" else defence_overrides(method, defence),
                               rounds, "local", ("training.local_epochs=1", f"seed={seed}"), arms, clean="clean" not in done)
    rows = old + [r for r in rows if r["fault"].removesuffix("+defence") not in done]
    out.write_text(json.dumps({"method": method, "defence": defence, "seed": seed, "rounds": rounds, "rows": rows}, indent=1))


def load(out_dir: Path) -> dict[tuple[str, str, int], dict[str, float]]:
    """(method, defence, seed) -> {experiment: final accuracy, None where the run failed} (experiment:
    clean, alie-1, ...)."""
    found = {}
    for path in sorted(out_dir.glob("*.json")):
        data = json.loads(path.read_text())
        found[(data["method"], data["defence"], data["seed"])] = {
            r["fault"].removesuffix("+defence"): r["final_accuracy"] if r["status"] == "completed" else None
            for r in data["rows"]}
    return found


def table(out_dir: Path, defences: list[str]) -> str:
    found = load(out_dir)
    methods = sorted({m for m, _, _ in found}, key=lambda m: list(DEFAULTS).index(m) if m in DEFAULTS else 99)
    lines = ["| method | attack | hostile | " + " | ".join(f"{d}: acc (Δ clean, Δ absent)" for d in defences) + " |",
             "|---|---|---|" + "---|" * len(defences)]
    for method in methods:
        for attack in [a for a in ATTACKS if a != "absent"]:
            for hostile in (1, 2):
                cells = []
                for defence in defences:
                    seeds = [s for (m, d, s) in found if m == method and d == defence]
                    runs = [found[(method, defence, s)] for s in seeds]
                    name = f"{attack}-{hostile}"
                    failed = sum(1 for r in runs if name in r and r[name] is None)
                    runs = [r for r in runs if r.get(name) is not None]
                    acc = [r[name] for r in runs]
                    clean = [r[name] - r["clean"] for r in runs if r.get("clean") is not None]
                    absent = [r[name] - r[f"absent-{hostile}"] for r in runs if r.get(f"absent-{hostile}") is not None]
                    if not acc:
                        cells.append(f"failed n={failed}" if failed else "–")
                        continue
                    gap = f"{100 * statistics.mean(absent):+.1f}" if absent else "–"
                    bold = absent and abs(100 * statistics.mean(absent)) <= 2 or absent and statistics.mean(absent) > 0
                    cells.append(f"{statistics.mean(acc):.3f} ({100 * statistics.mean(clean):+.1f}, "
                                 f"{'**' + gap + '**' if bold else gap}) n={len(acc)}" + (f", failed {failed}" if failed else ""))
                lines.append(f"| {method} | {LABELS.get(attack, attack)} | {hostile} | " + " | ".join(cells) + " |")
        refs = []
        for defence in defences:
            runs = [v for (m, d, s), v in found.items() if m == method and d == defence]
            clean = [r["clean"] for r in runs if r.get("clean") is not None]
            refs.append(f"clean {statistics.mean(clean):.3f}" if clean else "–")
        lines.append(f"| {method} | (clean) | 0 | " + " | ".join(refs) + " |")
    return "\n".join(lines) + ("\n\nΔ: points from the clean run and from the run without the hostile nodes, paired seed by "
                               "seed, same defence; bold: within 2 points of the run without the hostile nodes (or above it); "
                               "failed: runs that stopped without a final model (their row in the JSON says why); "
                               "–: not run.")


def absent_gap(found: dict, method: str, defence: str, attack: str, hostile: int) -> tuple[float, int] | None:
    """The mean over the seeds of the paired gap (accuracy points) of ``attack`` with ``hostile``
    nodes to the federation without them, same defence; with the seeds it has (None: no pair)."""
    name, gaps = f"{attack}-{hostile}", []
    for (m, d, _), runs in found.items():
        if m == method and d == defence and runs.get(name) is not None and runs.get(f"absent-{hostile}") is not None:
            gaps.append(100 * (runs[name] - runs[f"absent-{hostile}"]))
    return (statistics.mean(gaps), len(gaps)) if gaps else None


def goal(out_dir: Path, defences: list[str]) -> str:
    """Per defence and hostile count, the cells within 2 points of the federation without the
    hostile nodes (or above it), per method, over the attacks measured (the seeds in brackets)."""
    found = load(out_dir)
    methods = [m for m in DEFAULTS if any(k[0] == m for k in found)]
    lines = ["| defence | hostile | " + " | ".join(methods) + " | all |", "|---|---|" + "---|" * (len(methods) + 1)]
    for defence in defences:
        for hostile in (1, 2):
            cells, held, total = [], 0, 0
            for method in methods:
                gaps = [g for a in ATTACKS if a != "absent" and (g := absent_gap(found, method, defence, a, hostile))]
                ok = sum(1 for gap, _ in gaps if gap >= -2)
                seeds = sorted({n for _, n in gaps})
                cells.append(f"{ok}/{len(gaps)}" + (f" (n={'/'.join(map(str, seeds))})" if gaps else ""))
                held, total = held + ok, total + len(gaps)
            lines.append(f"| {defence} | {hostile} | " + " | ".join(cells) + f" | {held}/{total} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(DEFAULTS))
    parser.add_argument("--defences", nargs="+", default=["none", *CHAINS, "default", "trust"],
                        choices=["none", *CHAINS, "default", "trust"])
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS),
                        help="run these (one and two hostile nodes each) where a file lacks them; merged into it")
    parser.add_argument("--goal", action="store_true", help="no runs: the goal's count per method and defence")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out-dir", default="bench/results/field")
    parser.add_argument("--table", action="store_true", help="no runs: the table of what --out-dir holds")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    if args.table or args.goal:
        print(table(out_dir, args.defences) if args.table else goal(out_dir, args.defences))
        return
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    out_dir.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for method in args.methods:
            for defence in args.defences:
                run(method, defence, seed, args.rounds, out_dir / f"{method}_{defence}_s{seed}.json", tuple(args.attacks))
    print(table(out_dir, args.defences))


if __name__ == "__main__":
    main()
