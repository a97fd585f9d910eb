"""The local training loop of a client (plain PyTorch, no Flower types).

What a method changes (loss, optimizer step, state, extra records) comes in through its
client objective (:mod:`objectives`); this loop stays the same for all.

The module imports no Flower: :func:`train_epochs` is the loop itself (``bench/gpu_throughput.py``
runs it on a machine with PyTorch only); :func:`train` adds the reply's metric names from
:mod:`fedmm.protocol`, imported when first called.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

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
    training loss, seconds)."""
    start = time.perf_counter()
    training = update.local_training(training)
    model.to(device).train()
    update.begin(model, server_round)
    optimizer = torch.optim.SGD(model.parameters(), **update.optimizer_args(training, round_lr(training, server_round)))
    if training.clip_grad_norm is not None:  # before every step, whatever the objective's step does
        trained = [p for p in model.parameters() if p.requires_grad]
        max_norm = float(training.clip_grad_norm)

        def clip(*_: object) -> None:
            torch.nn.utils.clip_grad_norm_(trained, max_norm)

        optimizer.register_step_pre_hook(clip)
    losses, sizes = [], []
    for x, y in local_batches(data, training, generator, device):
        losses.append(update.step(model, optimizer, x, y).detach())  # kept on the device: no wait per step
        sizes.append(len(y))
    return mean_loss(losses, sizes), time.perf_counter() - start


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
