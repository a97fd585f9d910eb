"""Server-side cost of one aggregation step: FedAvg vs FedMR recombination vs FedCross
cross-aggregation (similarity included), for K models of the cnn / resnet20 / vgg16 sizes.

    python bench/server_cost.py                       # all sizes, K = 10 and 100
    python bench/server_cost.py --models cnn --ks 10  # a subset

Prints a table and writes bench/results/server_cost.json. Each step works on K models held
as dicts of numpy arrays, exactly as the strategies hold them, with the app's own functions
(FedAvg: ``weighted_mean_models``; FedMR: ``recombine``; FedCross: ``model_similarity`` +
``collaborative_models`` + ``cross_aggregate(consume=True)`` on models handed over as the
strategy does); time is the median of ``--repeat`` runs, memory is the peak of numpy
allocations (tracemalloc) above the K models the server already holds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

from fedmm.data import InputSpec
from fedmm.models import build_model
from strategies.aggregation import mean_models, weighted_mean_models
from strategies.cross_aggregation import collaborative_models, cross_aggregate, model_similarity
from strategies.recombination import recombine

SHAPES = {
    "cnn": InputSpec(kind="image", num_classes=10, shape=(1, 28, 28)),
    "resnet20": InputSpec(kind="image", num_classes=10, shape=(3, 32, 32)),
    "vgg16": InputSpec(kind="image", num_classes=10, shape=(3, 32, 32)),
}


def fedavg(models, weights):
    """FedAvg's aggregation as the app computes it (sample-size weighted mean)."""
    return weighted_mean_models(models, weights)


def fedmr(models, rng):
    return recombine(models, rng)


def fedcross(models, rnd, consume=False):
    """Similarity, lowest-similarity selection and cross-aggregation, as FedCross runs them
    (the strategy hands over the trained models, which are released key by key)."""
    sim = model_similarity(models)
    partners = collaborative_models(sim, "lowest-similarity", rnd, len(models))
    return cross_aggregate(models, partners, 0.99, consume=consume)


def measure(fn, repeat, setup=None):
    """Median seconds of ``fn(setup())`` and its peak traced allocation (setup not counted).

    Peak memory is the high point of traced allocations during the step minus what was held
    before it: with a ``setup`` that hands over fresh copies, inputs the step releases offset
    the outputs it builds.
    """
    times = []
    for _ in range(repeat):
        arg = setup() if setup else None
        t = time.perf_counter()
        result = fn(arg)
        times.append(time.perf_counter() - t)
        del result, arg
    tracemalloc.start()
    arg = setup() if setup else None
    before, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    result = fn(arg)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del result, arg
    return statistics.median(times), peak - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet20", "vgg16"])
    parser.add_argument("--ks", nargs="+", type=int, default=[10, 100])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-gib", type=float, default=12.0, help="skip sizes whose K models exceed this")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "server_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'model':<10}{'K':>5}{'size MB':>9}{'FedAvg ms':>11}{'FedMR ms':>10}{'FedCross ms':>13}{'MR/Avg':>8}{'Cross/Avg':>11}"
          f"{'peak MB (Avg/MR/Cross)':>26}")
    for name in args.models:
        base = build_model(name, SHAPES[name])
        state = {k: v.numpy() for k, v in base.state_dict().items()}
        size = sum(v.nbytes for v in state.values())
        for k in args.ks:
            if size * k > args.max_gib * 2**30:
                print(f"{name:<10}{k:>5}  skipped: {k} models = {size * k / 2**30:.1f} GiB > --max-gib {args.max_gib}")
                continue
            rng = np.random.default_rng(0)
            models = [{key: (v + rng.standard_normal(v.shape).astype(v.dtype) * 0.01) if v.dtype.kind == "f" else v.copy()
                       for key, v in state.items()} for _ in range(k)]
            weights = list(rng.integers(50, 500, size=k).astype(float))
            t_avg, m_avg = measure(lambda _: fedavg(models, weights), args.repeat)
            t_mr, m_mr = measure(lambda _: fedmr(models, np.random.default_rng(1)), args.repeat)
            t_x, m_x = measure(
                lambda owned: fedcross(owned, 3, consume=True),
                args.repeat,
                setup=lambda: [{key: v.copy() for key, v in m.items()} for m in models],
            )
            t_mean, _ = measure(lambda _: mean_models(models), args.repeat)
            row = dict(model=name, k=k, model_mb=size / 2**20, fedavg_ms=1e3 * t_avg, fedmr_ms=1e3 * t_mr,
                       fedcross_ms=1e3 * t_x, unweighted_mean_ms=1e3 * t_mean,
                       fedavg_peak_mb=m_avg / 2**20, fedmr_peak_mb=m_mr / 2**20, fedcross_peak_mb=m_x / 2**20)
            rows.append(row)
            print(f"{name:<10}{k:>5}{row['model_mb']:>9.2f}{row['fedavg_ms']:>11.1f}{row['fedmr_ms']:>10.2f}{row['fedcross_ms']:>13.1f}"
                  f"{t_mr / t_avg:>8.3f}{t_x / t_avg:>11.2f}{m_avg / 2**20:>10.1f}/{m_mr / 2**20:.2f}/{m_x / 2**20:.1f}", flush=True)
            del models
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "torch_threads": 1,
               "cpus": __import__("os").cpu_count()}
    out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
