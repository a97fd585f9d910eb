"""Clients per second: K clients' local training one after another against as one computation.

    .venv/bin/python bench/vectorized_throughput.py                                  # lenet cnn resnet20, K = 10 and 100, batch 10 and 50
    .venv/bin/python bench/vectorized_throughput.py --models lenet --clients 10 --batch-sizes 50 --repeats 5
    python bench/vectorized_throughput.py --device cuda                              # on a GPU machine
    python bench/vectorized_throughput.py --device cuda --models lenet resnet20 --shape cifar --clients 10 \
        --samples-per-client 500 --epochs 5 --batch-sizes 50 --projected-rounds 2000      # a round of the papers' CIFAR-10 shape

For each (model, K, batch size): K clients, each with its own seeded synthetic split
(``--samples-per-client`` rows; MNIST-shaped for ``lenet`` and ``cnn``, CIFAR-shaped for
``resnet20``) and its own starting weights, trained for ``--epochs`` epochs of SGD with the
declared training defaults (momentum 0.5), once by the ClientApp's loop one client after another
(:func:`client_app.training.train_epochs`, the sequential path), once by
:func:`client_app.vectorized.train_stacked` (all K as one ``torch.func`` computation). Reported:
clients per second of each (median of ``--repeats``, after an untimed warm-up), the speed-up,
the largest difference of any client's final weights between the two (float32: rounding only),
and on CUDA the peak memory per client of each path (the device cleared and its peak reset before
each path; both paths copy the clients' final weights to the host, as the ClientApp's replies do).
The JSON is written case by case (``bench/cases.py``): a run cut off keeps its finished cases, a
case that raises is recorded with its error, ``--resume`` runs only the missing cases.

Random data costs the same compute as real data; loading and partitioning, messages and
evaluation are not measured (``bench/e2e_overhead.py`` measures whole rounds).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import CaseLog  # noqa: E402 - bench/cases.py
from client_app.training import train_epochs  # noqa: E402
from client_app.vectorized import train_stacked  # noqa: E402
from fedmm.data import ImageNormalize, TensorData  # noqa: E402
from fedmm.data.spec import InputSpec  # noqa: E402
from fedmm.models import build_model  # noqa: E402
from fedmm.training import TrainingSettings  # noqa: E402

SPECS = {"lenet": InputSpec(kind="image", num_classes=10, shape=(1, 28, 28)),
         "cnn": InputSpec(kind="image", num_classes=10, shape=(1, 28, 28)),
         "resnet20": InputSpec(kind="image", num_classes=10, shape=(3, 32, 32))}


def client_data(rows: int, seed: int, shape: tuple[int, ...]) -> TensorData:
    g = torch.Generator().manual_seed(seed)
    return TensorData(x=torch.randint(0, 256, (rows, *shape), dtype=torch.uint8, generator=g),
                      y=torch.randint(0, 10, (rows,), generator=g), ids=None,
                      transform=ImageNormalize((0.5,) * shape[0], (0.25,) * shape[0]))


def starting_states(model: torch.nn.Module, k: int) -> list[dict[str, torch.Tensor]]:
    """K different starting points near ``model``'s weights (the multi-model methods send each
    client its own model); client c's noise is seeded by c."""
    base = model.state_dict()
    states = []
    for client in range(k):
        gen = torch.Generator().manual_seed(client)
        states.append({n: (v + 0.01 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone())
                       for n, v in base.items()})
    return states


#: ``--shape cifar``: every model on CIFAR-shaped inputs (the papers' CIFAR-10 experiments).
CIFAR = InputSpec(kind="image", num_classes=10, shape=(3, 32, 32))


def _on_host(states: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The clients' final weights copied to the host, as the ClientApp's replies carry them (and
    so that no earlier result holds device memory while another path is measured)."""
    return [{n: v.detach().to("cpu", copy=True) for n, v in state.items()} for state in states]


def case(model_name: str, k: int, batch: int, rows: int, epochs: int, device: torch.device, repeats: int,
         spec: InputSpec | None = None) -> dict:
    from fedmm.config import compose
    from objectives.base import build_local_update

    spec = spec or SPECS[model_name]
    torch.manual_seed(0)
    model = build_model(model_name, spec)
    states = starting_states(model, k)
    datas = [client_data(rows, 1000 + c, spec.shape) for c in range(k)]
    training = TrainingSettings().replace(local_epochs=epochs, batch_size=batch)
    update = build_local_update(compose([]))
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    reused = build_model(model_name, spec)  # as the ClientApp: one model, each client's weights loaded into it

    def sequential() -> list[dict[str, torch.Tensor]]:
        out = []
        for client in range(k):
            reused.load_state_dict(states[client])
            train_epochs(reused, datas[client], update, training, 1, torch.Generator().manual_seed(client), device)
            out += _on_host([reused.state_dict()])
        return out

    def vectorized() -> list[dict[str, torch.Tensor]]:
        results, _ = train_stacked(model, states, datas, training, 1,
                                   [torch.Generator().manual_seed(c) for c in range(k)], device, [update] * k)
        return _on_host([r.state for r in results])

    row: dict = {"model": model_name, "clients": k, "batch_size": batch, "rows_per_client": rows, "epochs": epochs,
                 "input_shape": list(spec.shape)}
    finals = {}
    for name, fn in (("sequential", sequential), ("vectorized", vectorized)):
        fn()  # warm-up (and the CUDA context, kernels, allocator)
        if cuda:  # the device cleared: what the path itself holds at its peak, nothing of the other path
            reused.to("cpu")
            model.to("cpu")
            gc.collect()
            sync()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            resident = torch.cuda.memory_allocated(device)
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            finals[name] = fn()
            sync()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        row[f"{name}_s"] = seconds
        row[f"{name}_clients_per_s"] = k / seconds
        if cuda:  # one client at a time holds one client's training; the stack holds k
            peak = torch.cuda.max_memory_allocated(device) - resident
            row[f"{name}_peak_mib_per_client"] = peak / 2**20 / (1 if name == "sequential" else k)
    row["speedup"] = row["sequential_s"] / row["vectorized_s"]
    row["max_weight_diff"] = max(float((a[n].float() - b[n].float()).abs().max())
                                 for a, b in zip(finals["sequential"], finals["vectorized"]) for n in a)
    return row


def machine_facts(device: torch.device) -> dict:
    """The host, torch, and on CUDA the device and whether float32 matrix work may use TF32."""
    facts = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
             "cores": os.cpu_count(), "threads": torch.get_num_threads(), "device": str(device),
             "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    if device.type == "cuda":
        facts.update(cuda=torch.version.cuda, tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                     tf32_cudnn=torch.backends.cudnn.allow_tf32)
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(SPECS), default=["lenet", "cnn", "resnet20"])
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 100])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[10, 50])
    parser.add_argument("--samples-per-client", type=int, default=50, help="rows per client (the papers' MNIST shape has ~40)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--shape", choices=("model", "cifar"), default="model",
                        help="model: MNIST-shaped for lenet and cnn, CIFAR-shaped for resnet20; cifar: CIFAR-shaped for all")
    parser.add_argument("--projected-rounds", type=int, default=None,
                        help="also report the local training of that many rounds of K clients, in minutes (e.g. 2000: "
                             "one row of the papers' tables; with --clients 10 --samples-per-client 500 --epochs 5 "
                             "--batch-sizes 50 --shape cifar, the papers' CIFAR-10 shape)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "vectorized_throughput.json"))
    parser.add_argument("--resume", action="store_true", help="keep the cases already in --out and run the others")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    machine = machine_facts(device)
    print(f"vectorized_throughput: {machine}", flush=True)
    log = CaseLog(args.out, {"machine": machine, "argv": sys.argv}, key=("model", "clients", "batch_size"), resume=args.resume)
    print(f"{'model':<10}{'K':>5}{'batch':>6}{'seq clients/s':>15}{'vec clients/s':>15}{'speed-up':>10}{'max|Δw|':>10}", flush=True)
    for model_name in args.models:
        for k in args.clients:
            for batch in args.batch_sizes:
                if log.finished(model=model_name, clients=k, batch_size=batch):
                    continue
                with log.case(model=model_name, clients=k, batch_size=batch) as row:
                    row.update(case(model_name, k, batch, args.samples_per_client, args.epochs, device, args.repeats,
                                    CIFAR if args.shape == "cifar" else None))
                    if args.projected_rounds:
                        for name in ("sequential", "vectorized"):
                            row[f"{name}_projected_min"] = row[f"{name}_s"] * args.projected_rounds / 60
                        row["projected_rounds"] = args.projected_rounds
                        print(f"  {args.projected_rounds} rounds of this local training: sequential "
                              f"{row['sequential_projected_min']:.1f} min, vectorized {row['vectorized_projected_min']:.1f} min",
                              flush=True)
                    print(f"{model_name:<10}{k:>5}{batch:>6}{row['sequential_clients_per_s']:>15.1f}"
                          f"{row['vectorized_clients_per_s']:>15.1f}{row['speedup']:>9.2f}x{row['max_weight_diff']:>10.1e}",
                          flush=True)
    log.finish()
    print(f"wrote {args.out}")
    if log.exit_status():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
