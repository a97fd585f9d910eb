"""FedRL's client: review learning (Wang et al. 2024)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fedmm.settings import Choice, setting
from objectives.base import (LocalUpdate, ObjectiveSettings, call_layers, call_prefix, cross_entropy, frozen, mu_settings,
                             only_rows, within)


@dataclass
class FedRLSettings(ObjectiveSettings):
    """The review term's weight μ and how the review depth advances."""

    option = "fedrl"
    title = "FedRL"
    _mu = mu_settings(
        {"mnist": 0.005, "mnist5k": 0.005, "fashion_mnist": 0.004, "cifar10": 0.001, "cifar100": 0.0001}, 0.001,
        "0.005 (MNIST), 0.004 (FashionMNIST), 0.001 (CIFAR-10), 0.0001 (CIFAR-100)")
    mu: float | None = _mu[0]
    mu_by_dataset: dict = _mu[1]
    default_mu: float = _mu[2]
    advance: str = setting("batch", Choice("batch", "round"), "the review depth m cycles 1..M batch by batch "
                           "(Algorithm 1) or one depth per round", paper="batch", label="depth by {}")


class FedRL(LocalUpdate):
    """Review learning (Wang et al. 2024, Algorithm 1 and Eq. 3).

    loss = CE + (μ/2)·‖kr_m − kr_{i,m}‖₂, where kr_m is the output of the first m layers of the
    received model (frozen, in eval mode, never updated) and kr_{i,m} that of the local model on
    the same batch. The review depth m cycles through 1..M (M = the model's ``num_layers``):
    batch by batch starting at 1 every round (``advance: batch``, Algorithm 1), or one depth per
    round (``advance: round``).
    """

    Settings = FedRLSettings

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Freeze a copy of the received model; reset the review depth."""
        self.reference = frozen(copy.deepcopy(model))
        self.num_layers = int(model.num_layers)
        self.server_round = server_round
        self.batches_seen = 0
        self._mu = self.mu()

    def review_depth(self, index: int | None = None) -> int:
        """m for batch number ``index`` of the round (default: the next one), in 1..M."""
        if self.params.advance == "round":
            return (self.server_round - 1) % self.num_layers + 1
        return (self.batches_seen if index is None else index) % self.num_layers + 1

    def tensors(self) -> dict[str, torch.Tensor]:
        """The received model's parameters and buffers (``reference.<name>``), run frozen in eval mode."""
        return {f"reference.{name}": value for name, value in self.reference.state_dict().items()}

    def batch_loss(self, model: nn.Module, weights: Mapping[str, torch.Tensor] | None, tensors: Mapping[str, torch.Tensor],
                   x: torch.Tensor, y: torch.Tensor, index: int, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.review_depth(index)
        # one pass through the local model gives both kr_{i,m} and the logits
        logits, kr_local = call_layers(model, weights, x, m)
        ce = cross_entropy(logits, y, rows)
        if self._mu == 0.0:
            return ce, logits
        with torch.no_grad():
            kr_global = call_prefix(self.reference, within(tensors, "reference."), x, m)
        review = torch.linalg.vector_norm(only_rows(kr_global - kr_local, rows))
        return ce + 0.5 * self._mu * review, logits
