"""The local training loop of a client (plain PyTorch, no Flower types).

What a method changes (loss, optimizer step, state, extra records) comes in through its
client objective (:mod:`objectives`); this loop stays the same for all.

The module imports no Flower: :func:`train_epochs` is the loop itself (``bench/gpu_throughput.py``
runs it on a machine with PyTorch only); :func:`train` adds the reply's metric names from
:mod:`fedmm.protocol`, imported when first called.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from fedmm.training import TrainingSettings, host_values, round_lr, weighted_sum
from objectives.base import LocalUpdate
from fedmm.data import TensorData, batches


def train_epochs(
    model: nn.Module,
    data: TensorData,
    update: LocalUpdate,
    training: TrainingSettings,
    server_round: int,
    generator: torch.Generator,
    device: torch.device,
) -> tuple[float, float]:
    """Run ``local_epochs`` (or ``local_steps`` steps) of SGD through ``update``; return (mean
    training loss, seconds).

    Every step is the same, whatever the objective: its gradient (:meth:`LocalUpdate.gradient`),
    its correction (:meth:`LocalUpdate.correct_gradient`), its clipping
    (:meth:`LocalUpdate.gradient_clip`), ``training.clip_grad_norm``, then SGD with its arguments
    (:meth:`LocalUpdate.optimizer_args`); after the last step the objective is told how many
    there were (:meth:`LocalUpdate.finish_steps`). The stacked path
    (:func:`client_app.vectorized.train_stacked`) takes the same steps for several clients."""
    start = time.perf_counter()
    training = update.local_training(training)
    model.to(device).train()
    update.start(model, data, server_round)
    optimizer = torch.optim.SGD(model.parameters(), **update.optimizer_args(training, round_lr(training, server_round)))
    losses, sizes = sgd_steps(model, update, optimizer, local_batches(data, training, generator, device),
                              None if training.clip_grad_norm is None else float(training.clip_grad_norm))
    return mean_loss(losses, sizes), time.perf_counter() - start


def sgd_steps(model: nn.Module, update: LocalUpdate, optimizer: torch.optim.Optimizer,
              batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
              max_norm: float | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """The loop's step on each batch, then :meth:`LocalUpdate.finish_steps` with their number and
    the optimizer's learning rate; (the batches' losses, kept on the device; their sizes).

    A step: the gradient (:meth:`LocalUpdate.gradient`), its correction
    (:meth:`LocalUpdate.correct_gradient`, a missing gradient read as zeros), the objective's
    clipping (:meth:`LocalUpdate.gradient_clip`), ``max_norm`` (``training.clip_grad_norm``), both
    over the trainable parameters' global L2 norm, then ``optimizer.step()``."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    trained = [p for _, p in named]
    corrects = type(update).correct_gradient is not LocalUpdate.correct_gradient
    objective_clip = update.gradient_clip()
    losses, sizes = [], []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = update.gradient(model, x, y)
        if corrects:
            grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in named}
            corrected = update.correct_gradient(grads, update.tensors())
            for name, p in named:
                p.grad = corrected[name]
        if objective_clip is not None:
            torch.nn.utils.clip_grad_norm_(trained, objective_clip)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(trained, max_norm)
        optimizer.step()
        losses.append(loss.detach())  # kept on the device: no wait per step
        sizes.append(len(y))
    update.finish_steps(len(sizes), float(optimizer.param_groups[0]["lr"]))
    return losses, sizes


def mean_loss(losses: list[torch.Tensor], sizes: list[int]) -> float:
    """The mean of batch losses weighted by their rows, read from the device once (each loss as
    the float it is, summed in double precision in batch order, as ``float(loss)`` per step did)."""
    return weighted_sum(host_values(losses), sizes) / max(sum(sizes), 1)


def local_batches(data: TensorData, training: TrainingSettings, generator: torch.Generator, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The round's minibatches: ``local_epochs`` reshuffled passes over ``data``, or, with
    ``local_steps``, passes until that many batches (the last pass cut short). ``drop_last``
    leaves out each pass's short batch, except when it is the only one: a client with fewer rows
    than a batch still trains on them (PyTorch's ``drop_last`` would give it no step at all, and
    SCAFFOLD's control update would divide by zero steps)."""
    steps = training.local_steps
    epochs = training.local_epochs if steps is None else None
    drop_last = training.drop_last and len(data) >= training.batch_size
    taken, passes = 0, 0
    while (epochs is None or passes < epochs) and (steps is None or taken < steps):
        before = taken
        for batch in batches(data, training.batch_size, shuffle=True, generator=generator, device=device, drop_last=drop_last):
            yield batch
            taken += 1
            if steps is not None and taken == steps:
                return
        passes += 1
        if taken == before:  # no batch in a pass: no step will ever be taken
            return


def train(
    model: nn.Module,
    data: TensorData,
    update: LocalUpdate,
    training: TrainingSettings,
    server_round: int,
    generator: torch.Generator,
    device: torch.device,
) -> dict[str, float]:
    """Run ``local_epochs`` of SGD through ``update``; return mean training loss, examples, seconds."""
    from fedmm.protocol import NUM_EXAMPLES  # here: the loop above runs without Flower installed

    train_loss, train_time = train_epochs(model, data, update, training, server_round, generator, device)
    return {"train_loss": train_loss, NUM_EXAMPLES: float(len(data)), "train_time": train_time}
