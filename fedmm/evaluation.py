"""Evaluation of a model on a split, and device selection: shared by the ServerApp (central
evaluation) and the ClientApp (federated evaluation)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from fedmm.data import TensorData, batches
from fedmm.protocol import NUM_EXAMPLES


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("training.device='cuda' but no CUDA device is visible on this node")
    return torch.device(name)


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorData, device: torch.device, batch_size: int = 500) -> dict[str, float]:
    """Accuracy, mean cross-entropy and example count of ``model`` on ``data``."""
    model.to(device).eval()
    loss_sum, correct = 0.0, 0
    for x, y in batches(data, batch_size, shuffle=False, generator=None, device=device):
        logits = model(x)
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    n = max(len(data), 1)
    return {"accuracy": correct / n, "loss": loss_sum / n, NUM_EXAMPLES: float(len(data))}
