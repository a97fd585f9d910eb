"""Seconds per round of Shakespeare-shaped work: 10 clients x 500 windows of 80 characters,
1 local epoch, char_lstm, every client every round, through ``fedmm`` (Ray simulation).

    python bench/text_throughput.py                       # fedavg fedmr fedcross, 3 rounds each
    python bench/text_throughput.py --strategies fedavg --rounds 5

The data is a LEAF-format folder written here (10 speakers, each repeating its own phrase), so
the bench runs offline; the work per round (windows, model, epochs) is what the task costs. The
first round includes Ray's start and is reported apart. Writes bench/results/text_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fedmm.data.text import ALPHABET  # noqa: E402


def write_leaf(root: Path, users: int, windows: int, seed: int = 0) -> None:
    """A LEAF Shakespeare folder: ``users`` speakers x ``windows`` training windows (+ 10 % test)."""
    rng = np.random.default_rng(seed)
    data = {"train": {}, "test": {}}
    test = max(1, windows // 10)
    for u in range(users):
        phrase = "".join(rng.choice(list(ALPHABET[14:]), size=int(rng.integers(5, 40)))) + " "
        text = phrase * ((windows + test + 81) // len(phrase) + 2)
        pairs = [(text[i : i + 80], text[i + 80]) for i in range(windows + test)]
        name = f"PLAY_{u}_ROLE"
        data["train"][name] = {"x": [p for p, _ in pairs[:windows]], "y": [c for _, c in pairs[:windows]]}
        data["test"][name] = {"x": [p for p, _ in pairs[windows:]], "y": [c for _, c in pairs[windows:]]}
    for split, users_data in data.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        names = sorted(users_data)
        content = {"users": names, "num_samples": [len(users_data[n]["y"]) for n in names], "user_data": users_data}
        (root / split / "all_data.json").write_text(json.dumps(content))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "fedmr", "fedcross"])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--windows", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "text_throughput.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedmm-text-"))
    write_leaf(work / "leaf", args.clients, args.windows)
    results = {}
    for strategy in args.strategies:
        out = work / strategy
        cmd = [sys.executable, "-m", "fedmm", f"strategy={strategy}", "dataset=shakespeare", f"dataset.path={work / 'leaf'}",
               "model=char_lstm", "partition=natural", f"num_clients={args.clients}", f"clients_per_round={args.clients}",
               f"num_rounds={args.rounds}", "training.local_epochs=1", f"hydra.run.dir={out}"]
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        seconds = [b["seconds"] - a["seconds"] for a, b in zip(rows, rows[1:])]
        results[strategy] = {"first_round_s": seconds[0], "later_rounds_s": seconds[1:],
                             "mean_later_round_s": float(np.mean(seconds[1:])) if len(seconds) > 1 else None,
                             "final_accuracy": rows[-1]["accuracy"]}
        print(f"{strategy:<10} round 1 {seconds[0]:6.2f} s (Ray start included), later rounds "
              f"{', '.join(f'{s:.2f}' for s in seconds[1:])} s, accuracy {rows[-1]['accuracy']:.3f}")
    Path(args.out).write_text(json.dumps({"clients": args.clients, "windows_per_client": args.windows, "local_epochs": 1,
                                          "rounds": args.rounds, "results": results}, indent=2))


if __name__ == "__main__":
    main()
