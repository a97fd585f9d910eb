"""The local training loop of a client (plain PyTorch, no Flower types).

What a method changes (loss, optimizer step, state, extra records) comes in through its
client objective (:mod:`objectives`); this loop stays the same for all.

The module imports no Flower: :func:`train_epochs` is the loop itself (``bench/gpu_throughput.py``
runs it on a machine with PyTorch only); :func:`train` adds the reply's metric names from
:mod:`fedmm.protocol`, imported when first called.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from fedmm.training import TrainingSettings, round_lr
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
    """Run ``local_epochs`` of SGD through ``update``; return (mean training loss, seconds)."""
    start = time.perf_counter()
    model.to(device).train()
    update.begin(model, server_round)
    optimizer = torch.optim.SGD(model.parameters(), **update.optimizer_args(training, round_lr(training, server_round)))
    total_loss, total_seen = 0.0, 0
    for _ in range(training.local_epochs):
        for x, y in batches(data, training.batch_size, shuffle=True, generator=generator, device=device):
            loss = update.step(model, optimizer, x, y)
            total_loss += float(loss.detach()) * len(y)
            total_seen += len(y)
    return total_loss / max(total_seen, 1), time.perf_counter() - start


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
