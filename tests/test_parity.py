"""bench/parity.py: the table arithmetic, and a whole bench run against a small fake of the FedMR
authors' repository (the same layout, function signatures and calling conventions as theirs:
``main_fed.FedAvg(net, dtr, dte, dict_users)`` reading the module-global ``args``,
``Algorithm.Training_FedMR.FedMR(args, ...)``, models returning ``{'output': logits}``, results
through ``utils.utils.save_result``, ``args.ensemble_alpha`` read but not defined, ``ujson``
imported at module level), so it needs no checkout of theirs."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _parity():
    if "parity_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("parity_bench", ROOT / "bench" / "parity.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["parity_bench"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["parity_bench"]


def test_summary_pairs_seeds_and_gives_final_best_and_delta() -> None:
    parity = _parity()
    runs = [
        {"seed": 0, "ours": [50.0, 60.0], "theirs": [49.0, 58.0]},
        {"seed": 1, "ours": [57.0, 55.0], "theirs": [50.0, 52.0]},
        {"seed": 2, "ours": [40.0, 41.0], "theirs": None},  # their run failed: ours counts, no delta
    ]
    row = parity.summarize(runs)
    assert row["seeds"] == 2 and row["ours_runs"] == 3 and row["theirs_runs"] == 2
    mean, std = row["ours_final"]
    assert mean == pytest.approx((60 + 55 + 41) / 3) and std == pytest.approx(math.sqrt(((60 - 52) ** 2 + (55 - 52) ** 2 + (41 - 52) ** 2) / 2))
    assert row["theirs_final"] == pytest.approx((55.0, math.sqrt(18.0)))
    assert row["delta_final"] == pytest.approx((2.5, math.sqrt(0.5)))   # 60-58, 55-52
    assert row["ours_best"][0] == pytest.approx((60 + 57 + 41) / 3)     # best of each curve, not of the final
    assert row["delta_best"] == pytest.approx((3.5, math.sqrt(4.5)))    # 60-58, 57-52
    one = parity.summarize([{"seed": 0, "ours": [70.0], "theirs": [71.5]}])
    assert one["delta_final"] == (-1.5, None)  # one seed: no spread

    table = parity.markdown_table({"fedavg": row, "fedmr": one}, {"fedcross": "no source"}, {"fedgen": "seed 0: boom"})
    lines = table.splitlines()
    assert lines[2].startswith("| fedavg ⚠ | 2 | 52.00 ± 9.85 | 55.00 ± 4.24 | +2.50 ± 0.71 | 52.67 ± 10.21 |")
    assert lines[3] == "| fedmr ⚠ | 1 | 70.00 | 71.50 | -1.50 | 70.00 | 71.50 | -1.50 | — |"
    assert "| fedgen | 0 | failed: seed 0: boom |" in table and "| fedcross | — | not run: no source |" in table
    calm = parity.summarize([{"seed": 0, "ours": [70.0], "theirs": [70.5]}])
    assert "⚠" not in parity.markdown_table({"fedavg": calm}, {}, {})


def test_a_methods_delta_is_read_against_fedavgs_delta_of_the_same_seed() -> None:
    """The client sequences' share of a seed's Δ is common to the methods that draw clients as
    FedAvg does on both sides: the column subtracts FedAvg's Δ seed by seed (only the seeds both
    have), and stays empty for the methods that draw clients otherwise."""
    parity = _parity()

    def method(deltas: dict[int, float]) -> dict:
        return {"runs": [{"seed": s, "ours_points": [60.0, 70.0 + d], "theirs_points": [60.0, 70.0]} for s, d in deltas.items()]}

    result = {"methods": {"fedavg": method({0: -6.0, 1: 5.0, 2: 1.0}), "fedprox": method({0: -5.0, 1: 3.0}),
                          "fedmr": method({0: 0.0, 1: 5.0, 3: 9.0}), "clusamp": method({0: -3.0, 1: 2.0})}}
    rows, _ = parity.table_rows(result)
    assert "delta_final_vs_fedavg" not in rows["fedavg"]
    assert rows["fedprox"]["delta_final_vs_fedavg"] == pytest.approx((-0.5, math.sqrt(4.5)))  # +1, -2
    assert rows["fedmr"]["delta_final_vs_fedavg"] == pytest.approx((3.0, math.sqrt(18.0)))   # +6, 0; seed 3 unpaired
    assert rows["fedprox"]["delta_final"] == pytest.approx((-1.0, math.sqrt(32.0)))           # the plain Δ unchanged
    assert "delta_final_vs_fedavg" not in rows["clusamp"]  # draws its clients from clusters
    table = parity.markdown_table(rows, {}, {})
    assert "| fedprox | 2 |" in table and table.split("| fedprox")[1].splitlines()[0].endswith("| -0.50 ± 2.12 |")
    assert table.split("| clusamp")[1].splitlines()[0].endswith("| — |")
    alone, _ = parity.table_rows({"methods": {"fedprox": result["methods"]["fedprox"]}})  # no FedAvg row: empty
    assert alone["fedprox"]["delta_final_vs_fedavg"] == (None, None)


def test_their_fraction_gives_their_number_of_clients() -> None:
    parity = _parity()
    for n, k in [(20, 10), (100, 10), (100, 29), (7, 3), (4, 2), (100, 57)]:
        args = parity.parse_args(["--authors", "x", "--num-clients", str(n), "--clients-per-round", str(k)])
        flags = parity.their_flags(args, parity.METHODS["fedavg"], 0)
        frac = float(flags[flags.index("--frac") + 1])
        assert max(int(frac * n), 1) == k  # their m = max(int(args.frac * args.num_users), 1)


FAKE = {
    "utils/__init__.py": "",
    "models/__init__.py": "",
    "Algorithm/__init__.py": "",
    "utils/options.py": """
        import argparse

        def args_parser():
            p = argparse.ArgumentParser()
            for flag, kind, default in [("--epochs", int, 500), ("--num_users", int, 100), ("--frac", float, 0.1),
                                        ("--local_ep", int, 5), ("--local_bs", int, 50), ("--bs", int, 128),
                                        ("--lr", float, 0.01), ("--momentum", float, 0.5), ("--algorithm", str, "FedAvg"),
                                        ("--model", str, "resnet20"), ("--dataset", str, "cifar10"),
                                        ("--generate_data", int, 1), ("--iid", int, 1), ("--noniid_case", int, 0),
                                        ("--data_beta", float, 0.5), ("--num_classes", int, 10),
                                        ("--num_channels", int, 3), ("--gpu", int, 0), ("--seed", int, 1),
                                        ("--first_stage_bound", int, 0)]:
                p.add_argument(flag, type=kind, default=default)
            return p.parse_args()
    """,
    "utils/set_seed.py": """
        import random
        import numpy as np
        import torch

        def set_random_seed(seed):
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
    """,
    "utils/dataset_utils.py": """
        import ujson  # as theirs: imported, unused
    """,
    "utils/utils.py": """
        import os

        def save_result(data, ylabel, args):
            os.makedirs('./output', exist_ok=True)
            with open('./output/{}_{}.txt'.format(args.algorithm, ylabel), 'a') as f:
                f.write('base ' + ' '.join(str(x) for x in data) + '\\n')
    """,
    "models/test.py": """
        import torch
        import torch.nn.functional as F
        from torch.utils.data import DataLoader

        def test_img(net_g, datatest, args):
            net_g.eval()
            correct, loss = 0, 0.0
            with torch.no_grad():
                for data, target in DataLoader(datatest, batch_size=args.bs):
                    out = net_g(data)['output']
                    loss += F.cross_entropy(out, target, reduction='sum').item()
                    correct += out.argmax(1).eq(target).long().sum()
            return 100.00 * correct / len(datatest), loss / len(datatest)
    """,
    "models/Update.py": """
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, Dataset

        class DatasetSplit(Dataset):
            def __init__(self, dataset, idxs):
                self.dataset, self.idxs = dataset, list(idxs)
            def __len__(self):
                return len(self.idxs)
            def __getitem__(self, item):
                return self.dataset[self.idxs[item]]

        class LocalUpdate_FedAvg(object):
            def __init__(self, args, dataset=None, idxs=None):
                self.args = args
                self.ensemble_alpha = args.ensemble_alpha  # as theirs: read, never defined by options.py
                self.ldr_train = DataLoader(DatasetSplit(dataset, idxs), batch_size=args.local_bs, shuffle=True)

            def train(self, net):
                net.train()
                opt = torch.optim.SGD(net.parameters(), lr=self.args.lr, momentum=self.args.momentum)
                for _ in range(self.args.local_ep):
                    for images, labels in self.ldr_train:
                        net.zero_grad()
                        nn.CrossEntropyLoss()(net(images)['output'], labels).backward()
                        opt.step()
                return net.state_dict()
    """,
    "Algorithm/Training_FedMR.py": """
        import copy
        import random
        import numpy as np
        from models.Update import LocalUpdate_FedAvg
        from models.test import test_img
        from utils.utils import save_result

        def FedMR(args, net_glob, dataset_train, dataset_test, dict_users):
            m = max(int(args.frac * args.num_users), 1)
            w_locals = [copy.deepcopy(net_glob.state_dict()) for _ in range(m)]
            acc = []
            for iter in range(args.epochs):
                for i, idx in enumerate(np.random.choice(range(args.num_users), m, replace=False)):
                    net_glob.load_state_dict(w_locals[i])
                    w_locals[i] = copy.deepcopy(LocalUpdate_FedAvg(args, dataset_train, dict_users[idx]).train(net_glob))
                net_glob.load_state_dict({k: sum(w[k] for w in w_locals) / m for k in w_locals[0]})
                if iter % 10 == 9:
                    acc.append(test_img(net_glob, dataset_test, args)[0].item())
                new = copy.deepcopy(w_locals)
                order = list(range(m))
                for k in w_locals[0]:
                    random.shuffle(order)
                    for i in range(m):
                        new[i][k] = w_locals[order[i]][k]
                w_locals = new
            save_result(acc, 'test_acc', args)
    """,
    "main_fed.py": """
        import copy
        import numpy as np
        from utils.options import args_parser
        from utils.set_seed import set_random_seed
        from utils.dataset_utils import *
        from utils.utils import save_result
        from models.test import test_img
        from models.Update import LocalUpdate_FedAvg
        from Algorithm.Training_FedMR import FedMR

        def FedAvg(net_glob, dataset_train, dataset_test, dict_users):
            acc = []
            for iter in range(args.epochs):
                m = max(int(args.frac * args.num_users), 1)
                w_locals, lens = [], []
                for idx in np.random.choice(range(args.num_users), m, replace=False):
                    w_locals.append(LocalUpdate_FedAvg(args, dataset_train, dict_users[idx]).train(copy.deepcopy(net_glob)))
                    lens.append(len(dict_users[idx]))
                net_glob.load_state_dict({k: sum(w[k] * n for w, n in zip(w_locals, lens)) / sum(lens) for k in w_locals[0]})
                if iter % 10 == 9:
                    acc.append(test_img(net_glob, dataset_test, args)[0].item())
            save_result(acc, 'test_acc', args)

        if __name__ == '__main__':
            raise SystemExit('the parity driver must not run this block')
    """,
}


def test_bench_runs_both_sides_against_a_fake_authors_repo(tmp_path: Path) -> None:
    authors = tmp_path / "FedMR"
    for name, text in FAKE.items():
        (authors / name).parent.mkdir(parents=True, exist_ok=True)
        (authors / name).write_text(textwrap.dedent(text))
    out, md = tmp_path / "parity.json", tmp_path / "parity.md"
    md.write_text("# notes\n\nkept above\n\n<!-- parity:begin -->\nold table\n<!-- parity:end -->\n\nkept below\n")
    cmd = [sys.executable, str(ROOT / "bench" / "parity.py"), "--authors", str(authors),
           "--methods", "fedavg", "fedcross", "--seeds", "3", "--rounds", "10", "--num-clients", "4",
           "--clients-per-round", "2", "--local-epochs", "1", "--model", "cnn", "--lr", "0.05", "--alpha", "1.0",
           "--override", "dataset.test_fraction=0.9",  # 500 training images: a fast run
           "--workdir", str(tmp_path / "work"), "--out", str(out), "--markdown", str(md)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = json.loads(out.read_text())
    (run,) = result["methods"]["fedavg"]["runs"]
    assert "ours_error" not in run and "theirs_error" not in run, run
    assert run["ours"]["rounds"] == [0, 10] and run["theirs"]["rounds"] == [10]
    # the same initial weights, test images and normalisation on both sides
    assert run["initial_match"] is True and 0 < run["ours_initial"] < 30
    assert 25 < run["ours_points"][0] <= 100 and 25 < run["theirs_points"][0] <= 100  # both trained
    assert {"driver", "ensemble_alpha", "model_interface", "record_results"} <= set(run["patches"])
    # their files were written where their code writes them, in the run's own folder
    saved = (tmp_path / "work" / "fedavg" / "theirs_s3" / "output" / "FedAvg_test_acc.txt").read_text().split()
    assert float(saved[1]) == pytest.approx(run["theirs_points"][0])
    delta = run["ours_points"][0] - run["theirs_points"][0]
    assert result["table"]["fedavg"]["delta_final"][0] == pytest.approx(delta)
    assert "fedcross" in result["not_run"]

    text = md.read_text()
    assert text.startswith("# notes\n\nkept above\n") and text.rstrip().endswith("kept below") and "old table" not in text
    assert f"| fedavg{' ⚠' if abs(delta) > 1 else ''} | 1 | {run['ours_points'][0]:.2f} | {run['theirs_points'][0]:.2f} | {delta:+.2f} |" in text
    assert "| fedcross | — | not run:" in text and "`ensemble_alpha`" in text


def test_bench_drives_their_multi_model_function_signature(tmp_path: Path) -> None:
    """FedMR-style functions take ``args`` first; their side alone (no simulation)."""
    authors = tmp_path / "FedMR"
    for name, text in FAKE.items():
        (authors / name).parent.mkdir(parents=True, exist_ok=True)
        (authors / name).write_text(textwrap.dedent(text))
    out = tmp_path / "parity.json"
    cmd = [sys.executable, str(ROOT / "bench" / "parity.py"), "--authors", str(authors), "--methods", "fedmr",
           "--seeds", "0", "1", "--rounds", "20", "--num-clients", "4", "--clients-per-round", "2", "--local-epochs", "1", "--lr", "0.1",
           "--model", "lenet", "--override", "dataset.test_fraction=0.9", "--sides", "theirs",
           "--workdir", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())["methods"]["fedmr"]["runs"]
    assert [len(r["theirs_points"]) for r in runs] == [2, 2] and runs[0]["theirs_points"] != runs[1]["theirs_points"]
    row = json.loads(out.read_text())["table"]["fedmr"]
    assert row["theirs_runs"] == 2 and row["seeds"] == 0


def test_merge_joins_runs_by_method_and_seed_and_refuses_other_settings() -> None:
    parity = _parity()
    settings = {"rounds": 20, "seeds": [0, 1], "authors": "/a", "num_clients": 20, "lr": 0.01}

    def result(seeds, methods, **changes):
        runs = lambda m: [{"seed": s, "ours_points": [50.0 + s, 60.0 + s], "theirs_points": [49.0, 58.0 + s + (m == "fedmr")]}
                          for s in seeds]  # noqa: E731
        return {"settings": {**settings, **changes, "seeds": seeds}, "partition_sha256": "abc", "command": f"c{seeds}",
                "methods": {m: {"ours": [f"strategy={m}"], "theirs": m, "their_flags": [], "runs": runs(m)} for m in methods},
                "not_run": {"fedgen": "later"}, "seconds": 10.0}

    merged = parity.merge_results([result([0, 1], ["fedavg", "fedmr"]), result([2], ["fedavg", "fedmr", "fedgen"], authors="/b")])
    assert merged["settings"]["seeds"] == [0, 1, 2] and merged["merged_from"] == ["c[0, 1]", "c[2]"]
    again = parity.merge_results([{**merged, "command": "the merge"}, result([3], ["fedavg"])])
    assert again["merged_from"] == ["c[0, 1]", "c[2]", "c[3]"]  # the runs' commands, not the earlier merge's
    assert [r["seed"] for r in merged["methods"]["fedmr"]["runs"]] == [0, 1, 2]
    assert "fedgen" in merged["methods"] and "fedgen" not in merged["not_run"]  # run in the second file
    rows, _ = parity.table_rows(merged)
    assert rows["fedavg"]["seeds"] == 3 and rows["fedmr"]["delta_final"][0] == pytest.approx(1.0)  # 60+s - (59+s)
    assert "Commands (one table" in parity.render_markdown({**merged, "settings": {**merged["settings"], "authors_commit": None,
                                                                                   "num_clients": 20, "clients_per_round": 10,
                                                                                   "alpha": 0.1, "min_partition_size": 10,
                                                                                   "partition_seed": 0, "local_epochs": 5,
                                                                                   "batch_size": 50, "momentum": 0.5,
                                                                                   "model": "cnn", "override": []}}, "x")
    with pytest.raises(SystemExit, match="different settings: \\['lr'\\]"):
        parity.merge_results([result([0], ["fedavg"]), result([1], ["fedavg"], lr=0.1)])
    other = result([1], ["fedavg"])
    other["partition_sha256"] = "def"
    with pytest.raises(SystemExit, match="different partition"):
        parity.merge_results([result([0], ["fedavg"]), other])


def test_collect_rebuilds_the_result_of_a_stopped_bench_from_its_folder(tmp_path: Path) -> None:
    parity = _parity()
    work = tmp_path / "work"

    def side(method: str, seed: int, theirs: list[float] | None, ours: list[float] | None, status: str = "completed") -> None:
        if theirs is not None:
            d = work / method / f"theirs_s{seed}"
            d.mkdir(parents=True)
            (d / "result.json").write_text(json.dumps({"initial_accuracy": 9.0, "accuracy": theirs, "rounds": [10, 20]}))
        if ours is not None:
            d = work / method / f"ours_s{seed}"
            d.mkdir(parents=True)
            rows = [{"round": r, "accuracy": a / 100} for r, a in zip([0, 10, 20], [9.0, *ours])]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (d / "summary.json").write_text(json.dumps({"status": status, "seconds": 5.0}))

    side("fedavg", 0, [70.0, 80.0], [71.0, 82.0])
    side("fedavg", 1, [72.0, 81.0], [70.0, 79.0])
    side("fedmr", 0, [60.0, 70.0], None)                     # ours never started
    side("fedmr", 1, [60.0, 70.0], [61.0, 69.0], "failed")   # ours stopped
    (work / "fedmut" / "theirs_s0").mkdir(parents=True)       # theirs still running
    (work / "partition.json").write_text("{}")
    args = parity.parse_args(["--collect", str(work), "--rounds", "20"])
    result = parity.collect(work, parity.settings_of(args, Path(".")), 20)
    assert sorted(result["methods"]) == ["fedavg"] and result["settings"]["seeds"] == [0, 1]
    assert sorted(result["incomplete"]) == ["fedmr seed 0", "fedmr seed 1", "fedmut seed 0"]
    rows, _ = parity.table_rows(result)
    assert rows["fedavg"]["delta_final"][0] == pytest.approx(0.0)  # (82-80 + 79-81) / 2
    assert all(r["initial_match"] for r in result["methods"]["fedavg"]["runs"])
