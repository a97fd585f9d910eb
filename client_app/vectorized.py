"""Several clients' local training as one computation: stacked parameters, ``torch.func``.

The K clients of a round that share an architecture train together: their parameters and
buffers are stacked along a new first dimension, and each SGD step is one ``vmap`` over the
clients of ``grad`` of the batch loss through ``functional_call``. Every client keeps what the
sequential loop (:func:`client_app.training.train_epochs`) gives it:

- its batches, in the order the sequential loop draws them (:func:`client_app.training.local_batches`
  with the client's own generator);
- its SGD state: momentum buffer, weight decay, the round's learning rate, gradient clipping by
  its own norm (``torch.nn.utils.clip_grad_norm_``'s arithmetic);
- its BatchNorm running statistics (buffers stacked like the parameters) and its own dropout draws
  (``randomness="different"``).

Ragged clients are exact: at each step the clients whose next batch has the same size train as
one group (gathered from the stack and written back); a client's short last batch trains in a
group of its own size, and a client that has run out of batches is in no group. No padded row
ever reaches a loss or a BatchNorm statistic.

The module imports no Flower.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn import functional as F

from client_app.training import local_batches
from fedmm.data import TensorData
from fedmm.training import TrainingSettings, round_lr

#: (model, parameters and buffers of one client, x, y) -> the batch's loss (a scalar).
LossFn = Callable[[nn.Module, dict[str, torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(model: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Plain cross-entropy of one client's batch (the loss of ``objectives.base.LocalUpdate``)."""
    return F.cross_entropy(functional_call(model, weights, (x,)), y)


@dataclass
class ClientResult:
    """One client's outcome, as the sequential loop returns it."""

    state: dict[str, torch.Tensor]
    train_loss: float
    steps: int


def train_stacked(
    model: nn.Module,
    states: Sequence[dict[str, torch.Tensor]],
    datas: Sequence[TensorData],
    training: TrainingSettings,
    server_round: int,
    generators: Sequence[torch.Generator],
    device: torch.device,
    loss_fn: LossFn = cross_entropy,
) -> tuple[list[ClientResult], float]:
    """Train ``len(states)`` clients of one architecture together; return each one's result
    and the seconds it all took.

    ``model`` gives the architecture only (its own weights are not used or changed); client k
    starts from ``states[k]`` (a state dict of ``model``'s keys), trains on ``datas[k]`` with
    ``generators[k]`` drawing its batch order, exactly as
    :func:`client_app.training.train_epochs` would with the same arguments.
    """
    start = time.perf_counter()
    k = len(states)
    if not (k == len(datas) == len(generators)) or k == 0:
        raise ValueError(f"one state, data split and generator per client: {len(states)}, {len(datas)}, {len(generators)}")
    model = model.to(device).train()
    param_names = [name for name, _ in model.named_parameters()]
    buffer_names = [name for name, _ in model.named_buffers()]
    for index, state in enumerate(states):
        if set(state) != set(param_names) | set(buffer_names):
            missing = sorted(set(param_names) | set(buffer_names) - set(state))
            extra = sorted(set(state) - set(param_names) - set(buffer_names))
            raise ValueError(f"client {index}'s state does not fit the model: missing {missing}, unexpected {extra}")
    params = {n: torch.stack([s[n] for s in states]).to(device) for n in param_names}
    buffers = {n: torch.stack([s[n] for s in states]).to(device) for n in buffer_names}
    momentum_buf = {n: torch.zeros_like(p) for n, p in params.items()}  # m * 0 + g = g: torch's first step, exactly

    lr = round_lr(training, server_round)
    momentum, weight_decay = float(training.momentum), float(training.weight_decay)
    max_norm = None if training.clip_grad_norm is None else float(training.clip_grad_norm)

    def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(model, {**p, **b}, x, y)

    step = vmap(grad_and_value(one), in_dims=(0, 0, 0, 0), randomness="different")

    streams = [local_batches(data, training, gen, device) for data, gen in zip(datas, generators)]
    totals = [0.0] * k
    seen = [0] * k
    steps = [0] * k
    active = list(range(k))
    while active:
        batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for client in active:
            batch = next(streams[client], None)
            if batch is not None:
                batches[client] = batch
        active = list(batches)
        groups: dict[tuple[int, ...], list[int]] = {}
        for client, (x, _) in batches.items():
            groups.setdefault(tuple(x.shape), []).append(client)
        for members in groups.values():
            whole = len(members) == k
            index = None if whole else torch.tensor(members, device=device)
            p = params if whole else {n: t.index_select(0, index) for n, t in params.items()}
            b = buffers if whole else {n: t.index_select(0, index) for n, t in buffers.items()}
            x = torch.stack([batches[c][0] for c in members])
            y = torch.stack([batches[c][1] for c in members])
            grads, losses = step(p, b, x, y)  # b's BatchNorm statistics are updated in place
            if max_norm is not None:  # clip_grad_norm_: one norm over all of a client's gradients
                norms = torch.stack([g.flatten(1).norm(2, dim=1) for g in grads.values()], dim=1).norm(2, dim=1)
                coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
                grads = {n: g * coef.view(-1, *([1] * (g.dim() - 1))) for n, g in grads.items()}
            for n, g in grads.items():
                if weight_decay:
                    g = g.add(p[n], alpha=weight_decay)
                if momentum:
                    buf = momentum_buf[n] if whole else momentum_buf[n].index_select(0, index)
                    buf.mul_(momentum).add_(g)
                    g = buf
                    if not whole:
                        momentum_buf[n].index_copy_(0, index, buf)
                if whole:
                    p[n].sub_(g, alpha=lr)
                else:
                    params[n].index_copy_(0, index, p[n].sub_(g, alpha=lr))
            if not whole:
                for n, t in b.items():
                    buffers[n].index_copy_(0, index, t)
            for client, loss in zip(members, losses.tolist()):
                n_rows = len(batches[client][1])
                totals[client] += loss * n_rows
                seen[client] += n_rows
                steps[client] += 1
    results = []
    for client, state in enumerate(states):
        out = {n: params[n][client] for n in param_names}
        out.update({n: buffers[n][client] for n in buffer_names})
        results.append(ClientResult({key: out[key] for key in state}, totals[client] / max(seen[client], 1), steps[client]))
    return results, time.perf_counter() - start
