"""Local training and evaluation on one client's data (plain PyTorch, no Flower types)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from client_app.objectives import Objective
from fedmm.data import ImageData, batches


def round_lr(training: Mapping[str, Any], server_round: int) -> float:
    """Learning rate of a round: ``lr`` times ``lr_decay_factor`` per passed decay round."""
    passed = sum(1 for r in training["lr_decay_rounds"] if server_round >= r)
    return float(training["lr"]) * float(training["lr_decay_factor"]) ** passed


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("training.device='cuda' but no CUDA device is visible on this node")
    return torch.device(name)


def train(
    model: nn.Module,
    data: ImageData,
    objective: Objective,
    training: Mapping[str, Any],
    dataset: Mapping[str, Any],
    server_round: int,
    generator: torch.Generator,
    device: torch.device,
) -> dict[str, float]:
    """Run ``local_epochs`` of SGD; return mean training loss, examples and seconds."""
    start = time.perf_counter()
    model.to(device).train()
    objective.start_round(model, server_round)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=round_lr(training, server_round),
        momentum=float(training["momentum"]),
        weight_decay=float(training["weight_decay"]),
    )
    total_loss, total_seen = 0.0, 0
    for _ in range(int(training["local_epochs"])):
        for x, y in batches(
            data,
            int(training["batch_size"]),
            shuffle=True,
            generator=generator,
            mean=dataset["mean"],
            std=dataset["std"],
            device=device,
        ):
            optimizer.zero_grad(set_to_none=True)
            loss, _ = objective.loss(model, x, y)
            loss.backward()
            optimizer.step()
            total_loss += float(loss.detach()) * len(y)
            total_seen += len(y)
    return {
        "train_loss": total_loss / max(total_seen, 1),
        "num-examples": float(len(data)),
        "train_time": time.perf_counter() - start,
    }


@torch.no_grad()
def evaluate(model: nn.Module, data: ImageData, dataset: Mapping[str, Any], device: torch.device, batch_size: int = 500) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``model`` on ``data``."""
    model.to(device).eval()
    loss_sum, correct = 0.0, 0
    for x, y in batches(data, batch_size, shuffle=False, generator=None, mean=dataset["mean"], std=dataset["std"], device=device):
        logits = model(x)
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    n = max(len(data), 1)
    return {"accuracy": correct / n, "loss": loss_sum / n, "num-examples": float(len(data))}
