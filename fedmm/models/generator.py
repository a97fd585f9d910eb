"""FedGen's generator and the losses that train it (Zhu, Hong, Zhou, ICML 2021), shared by the
server (which trains it) and the clients (which sample from it).

The generator maps noise ε (uniform on [0, 1), as both the original and the FedMR authors' code,
whose comments say "Gaussian") and a one-hot label y to a latent vector of the task model: the
input of its final linear classifier (``LayeredModel.latent_dim``):

    [ε, onehot(y)] → Linear(noise_dim + C, hidden) → BatchNorm1d → ReLU → Linear(hidden, d_lat)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class Generator(nn.Module):
    """FedGen's conditional generator of latent vectors."""

    def __init__(self, noise_dim: int, num_classes: int, latent_dim: int, hidden_dim: int = 512) -> None:
        super().__init__()
        self.noise_dim, self.num_classes, self.latent_dim = int(noise_dim), int(num_classes), int(latent_dim)
        self.fc = nn.Linear(self.noise_dim + self.num_classes, hidden_dim)
        self.bn = nn.BatchNorm1d(hidden_dim)
        self.out = nn.Linear(hidden_dim, self.latent_dim)

    def forward(self, labels: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent vectors, the noise they came from) for a batch of labels."""
        eps = torch.rand(len(labels), self.noise_dim, generator=generator, device=labels.device)
        onehot = F.one_hot(labels, self.num_classes).float()
        h = F.relu(self.bn(self.fc(torch.cat([eps, onehot], dim=1))))
        return self.out(h), eps


def label_weights(counts: np.ndarray, min_samples: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(w, qualified labels) from the sampled users' label counts (U × C):
    w[u, y] = count_u(y) / Σ_u count_u(y) (0 where no user has y), and the labels some user
    holds more than ``min_samples`` of."""
    counts = np.asarray(counts, dtype=np.float64)
    totals = counts.sum(axis=0)
    w = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    qualified = np.flatnonzero((counts > min_samples).any(axis=0))
    return w, qualified


def teacher_loss(z: torch.Tensor, labels: torch.Tensor, heads: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 weights: torch.Tensor) -> torch.Tensor:
    """Σ_u mean(CE(h_u(z), y) · w_u(y)) as both codes compute it: the per-sample CE (B,) times the
    weights (B, 1) broadcasts to B×B, so each term is mean_b(CE_b)·mean_b(w_u(y_b)) rather than a
    per-sample weighting. ``heads``: each user's classifier (weight C×d, bias C); ``weights``: U×C."""
    total = z.new_zeros(())
    for u, (w, b) in enumerate(heads):
        ce = F.cross_entropy(F.linear(z, w, b), labels, reduction="none")
        total = total + torch.mean(ce * weights[u, labels].reshape(-1, 1))
    return total


def diversity_loss(z: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """exp(−mean_{a,b}[d_L1(z_a, z_b)·d_L2(ε_a, ε_b)]) with d_L1 the mean absolute and d_L2 the
    mean squared difference over the vector (FedGen's DiversityLoss, metric l1 on the output).

    The pairwise distances come from ``torch.cdist`` (B × B) instead of a B × B × d difference
    tensor: the same values and gradients up to rounding, ~10× faster for B = 128, d = 512."""
    dz = torch.cdist(z, z, p=1) / z.shape[1]
    de = torch.cdist(eps, eps, p=2).pow(2) / eps.shape[1]
    return torch.exp(-torch.mean(dz * de))


def classifier_of(model: dict[str, np.ndarray]) -> tuple[str, str]:
    """Keys (weight, bias) of a state_dict's final linear classifier: its last 2-D weight and the
    bias after it (``LayeredModel``'s last block ends with the classifier)."""
    keys = list(model)
    for i in range(len(keys) - 1, -1, -1):
        if keys[i].endswith("weight") and np.ndim(model[keys[i]]) == 2:
            bias = keys[i][: -len("weight")] + "bias"
            if bias not in model:
                raise ValueError(f"the classifier {keys[i]!r} has no bias {bias!r}")
            return keys[i], bias
    raise ValueError("the model has no 2-D weight (no linear classifier)")
