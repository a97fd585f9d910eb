"""FedProx's client (Li et al., MLSys 2020): a proximal term to the received model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from collections.abc import Mapping

from objectives.base import LocalUpdate, ObjectiveSettings, mu_settings, parameters


@dataclass
class FedProxSettings(ObjectiveSettings):
    """μ of the proximal term (the FedMR / FedCross papers' values by dataset)."""

    option = "fedprox"
    title = "FedProx"
    _mu = mu_settings({"cifar10": 0.01, "cifar100": 0.001, "femnist": 0.1}, 0.01,
                                                "0.01 (CIFAR-10), 0.001 (CIFAR-100), 0.1 (FEMNIST)")
    mu: float | None = _mu[0]
    mu_by_dataset: dict = _mu[1]
    default_mu: float = _mu[2]


class FedProx(LocalUpdate):
    """CE + (μ/2)·‖w − w_global‖² over all trainable parameters (Li et al. 2020, Eq. 2)."""

    Settings = FedProxSettings

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Keep a detached copy of the received parameters."""
        self.names = [name for name, _ in model.named_parameters()]
        self.global_params = [p.detach().clone() for p in model.parameters()]
        self._mu = self.mu()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The received parameters (``anchor.<name>``)."""
        return {f"anchor.{name}": value for name, value in zip(self.names, self.global_params)}

    def batch_loss(self, model: nn.Module, weights: Mapping[str, torch.Tensor] | None, tensors: Mapping[str, torch.Tensor],
                   x: torch.Tensor, y: torch.Tensor, index: int, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ce, logits = super().batch_loss(model, weights, tensors, x, y, index, rows)
        if self._mu == 0.0:
            return ce, logits
        current = parameters(model, weights)
        prox = sum(((current[name] - tensors[f"anchor.{name}"]) ** 2).sum() for name in self.names)
        return ce + 0.5 * self._mu * prox, logits
