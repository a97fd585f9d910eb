"""Why K clients as one ``torch.func`` computation pay on this CPU at small batches only: the
convolution that ``vmap`` makes depends on whether the clients share their batch.

    .venv/bin/python bench/vmap_conv.py                                   # lenet, CIFAR- and MNIST-shaped, batch 10 and 50
    .venv/bin/python bench/vmap_conv.py --shapes cifar --batch-sizes 50 --repeats 9

K clients of ``lenet``, each with its own starting weights, take ``--steps`` SGD steps with
momentum, three ways, nothing of the app's training loop involved (``torch.func`` and the model
only):

- **sequential**: one client after another, ``torch.optim.SGD`` on each client's own batches;
- **vmap, one shared batch**: ``vmap(grad(loss), in_dims=(0, None, None))``, every client on the
  same batch. ``vmap`` turns each convolution over K weight sets and one input into ONE
  convolution with K times the output channels (and its backward into ordinary ones): a
  bigger, denser computation than K small ones;
- **vmap, each client its own batch**: ``in_dims=(0, 0, 0)``, as federated clients train (and as
  :func:`client_app.vectorized.train_stacked` runs them). Here ``vmap`` makes a GROUPED
  convolution (K groups), whose oneDNN kernels run no faster per image on this CPU than K small
  convolutions, backward pass included.

With ``--unfold``, a fourth: each client its own batch with every convolution written as
unfolded patches times the weights (``F.unfold`` and a matrix product, which ``vmap`` turns into
one batched ``bmm`` instead of a grouped convolution).

Reported: the median seconds of each (after a warm-up) and the speed-ups over the sequential
loop; the own-batch vmap's final weights against the sequential loop's (float32 rounding only).
Writes bench/results/vmap_conv.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedmm.data.spec import InputSpec  # noqa: E402
from fedmm.models import build_model  # noqa: E402

SHAPES = {"cifar": (3, 32, 32), "mnist": (1, 28, 28)}
LR, MOMENTUM = 0.01, 0.5


class UnfoldedConv2d(torch.nn.Conv2d):
    """``nn.Conv2d`` computed as unfolded patches times the weights (the same convolution)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        (kh, kw), (ph, pw), (sh, sw), (dh, dw) = self.kernel_size, self.padding, self.stride, self.dilation
        cols = F.unfold(x, self.kernel_size, self.dilation, self.padding, self.stride)
        out = self.weight.flatten(1) @ cols
        if self.bias is not None:
            out = out + self.bias.view(-1, 1)
        return out.view(n, self.out_channels, (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1)


def unfolded(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose convolutions are :class:`UnfoldedConv2d` (same parameter names)."""
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Conv2d:
                if child.groups != 1 or child.padding_mode != "zeros":
                    raise ValueError(f"{name}: only plain convolutions are unfolded")
                setattr(module, name, UnfoldedConv2d(child.in_channels, child.out_channels, child.kernel_size, child.stride,
                                                     child.padding, child.dilation, bias=child.bias is not None))
    return model


def case(shape_name: str, k: int, batch: int, steps: int, repeats: int, unfold: bool = False) -> dict:
    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    model = build_model("lenet", InputSpec(kind="image", num_classes=10, shape=shape))
    starts = []
    for client in range(k):
        gen = torch.Generator().manual_seed(client)
        starts.append({n: p.detach() + 0.01 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()})
    gen = torch.Generator().manual_seed(1234)
    xs = torch.randn(steps, k, batch, *shape, generator=gen)  # step, client, row
    ys = torch.randint(0, 10, (steps, k, batch), generator=gen)

    unfolded_model = unfolded(model) if unfold else None

    def loss(params: dict, x: torch.Tensor, y: torch.Tensor, arch: torch.nn.Module = model) -> torch.Tensor:
        return F.cross_entropy(functional_call(arch, params, (x,)), y)

    def sequential() -> list[dict]:
        out = []
        for client in range(k):
            m = copy.deepcopy(model)
            m.load_state_dict(starts[client], strict=False)
            opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)
            for s in range(steps):
                opt.zero_grad()
                F.cross_entropy(m(xs[s, client]), ys[s, client]).backward()
                opt.step()
            out.append({n: p.detach() for n, p in m.named_parameters()})
        return out

    def stacked(shared: bool, arch: torch.nn.Module = model) -> dict:
        params = {n: torch.stack([s[n] for s in starts]) for n in starts[0]}
        buf = {n: torch.zeros_like(p) for n, p in params.items()}
        step = vmap(grad(lambda p, x, y: loss(p, x, y, arch)), in_dims=(0, None, None) if shared else (0, 0, 0))
        for s in range(steps):
            grads = step(params, xs[s, 0], ys[s, 0]) if shared else step(params, xs[s], ys[s])
            for n, g in grads.items():
                buf[n].mul_(MOMENTUM).add_(g)
                params[n].sub_(buf[n], alpha=LR)
        return params

    row: dict = {"model": "lenet", "shape": list(shape), "clients": k, "batch_size": batch, "steps": steps}
    finals = {}
    ways = [("sequential", sequential), ("vmap_shared_batch", lambda: stacked(True)),
            ("vmap_own_batches", lambda: stacked(False))]
    if unfold:
        ways.append(("vmap_own_batches_unfolded", lambda: stacked(False, unfolded_model)))
    for name, fn in ways:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            finals[name] = fn()
            times.append(time.perf_counter() - start)
        row[f"{name}_s"] = statistics.median(times)
    for name, _ in ways[1:]:
        row[f"{name}_speedup"] = row["sequential_s"] / row[f"{name}_s"]
    for name, key in (("vmap_own_batches", "own_batches_max_weight_diff"),
                      ("vmap_own_batches_unfolded", "unfolded_max_weight_diff")):
        if name in finals:
            own = finals[name]
            row[key] = max(float((own[n][c] - finals["sequential"][c][n]).abs().max()) for c in range(k) for n in own)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["cifar", "mnist"])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[10, 50])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--unfold", action="store_true", help="also time the convolutions as unfolded patches times the weights")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "vmap_conv.json"))
    args = parser.parse_args()
    machine = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
               "cores": os.cpu_count(), "threads": torch.get_num_threads()}
    print(f"vmap_conv: {machine}", flush=True)
    print(f"{'shape':<7}{'K':>4}{'batch':>6}{'sequential s':>14}{'shared-batch vmap':>19}{'own-batch vmap':>16}{'max|Δw|':>10}",
          flush=True)
    rows = []
    for shape in args.shapes:
        for batch in args.batch_sizes:
            row = case(shape, args.clients, batch, args.steps, args.repeats, args.unfold)
            rows.append(row)
            print(f"{shape:<7}{args.clients:>4}{batch:>6}{row['sequential_s']:>14.3f}"
                  f"{row['vmap_shared_batch_s']:>10.3f} {row['vmap_shared_batch_speedup']:>5.2f}x"
                  f"{row['vmap_own_batches_s']:>9.3f} {row['vmap_own_batches_speedup']:>5.2f}x"
                  f"{row['own_batches_max_weight_diff']:>10.1e}"
                  + (f"   unfolded {row['vmap_own_batches_unfolded_s']:.3f} {row['vmap_own_batches_unfolded_speedup']:.2f}x "
                     f"(max|Δw| {row['unfolded_max_weight_diff']:.1e})" if args.unfold else ""), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine, "argv": sys.argv, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
