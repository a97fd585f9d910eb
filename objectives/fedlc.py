"""FedLC: federated learning with label-distribution-calibrated logits (Zhang et al., ICML 2022).

Under label skew a client's classifier learns to favour its own frequent classes. FedLC
calibrates every logit by the client's count of that class before the cross-entropy: with n_c
the rows of class c the client trains on (its data summary, :meth:`LocalUpdate.label_counts`)
and τ the calibration strength,

    z̃_c = z_c − τ · n_c^(−1/4)          loss = CE(z̃, y)

so a frequent class's logit is lowered less than a rare one's, and the model must put more
margin on the rare classes to fit them. A class the client has no row of gets n_c^(−1/4) = ∞:
its calibrated logit is −∞ and leaves the softmax (the client says nothing about that class).
The server is FedAvg's (``objective=fedlc`` under any method).

One loss definition, :meth:`FedLC.batch_loss`, serves both training paths: the calibration is
the client's own tensor (:meth:`FedLC.tensors`), stacked when a round's clients train together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fedmm.settings import Number, setting
from objectives.base import LocalUpdate, ObjectiveSettings, call, cross_entropy


@dataclass
class FedLCSettings(ObjectiveSettings):
    """FedLC's calibration strength τ."""

    option = "fedlc"
    title = "FedLC"
    tau: float = setting(1.0, Number(gt=0), "τ: each logit z_c is lowered by τ·n_c^(−1/4), n_c the client's rows of class c",
                         paper="τ tuned per dataset (Zhang et al., ICML 2022)", label="τ {}")


def calibration(counts: torch.Tensor, tau: float) -> torch.Tensor:
    """τ·n_c^(−1/4) per class (∞ for a class with no row), float32."""
    return tau * counts.to(torch.float32).pow(-0.25)


class FedLC(LocalUpdate):
    """The calibrated cross-entropy (module docstring)."""

    Settings = FedLCSettings

    def begin(self, model: nn.Module, server_round: int) -> None:
        """The client's calibration, from the class counts of the rows it trains on this round."""
        device = next(model.parameters()).device
        self.offset = calibration(self.label_counts(), float(self.params.tau)).to(device)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"offset": self.offset}

    def batch_loss(self, model: nn.Module, weights: Mapping[str, torch.Tensor] | None, tensors: Mapping[str, torch.Tensor],
                   x: torch.Tensor, y: torch.Tensor, index: int, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """CE of the calibrated logits z − τ·n^(−1/4); the logits returned are the model's own."""
        logits = call(model, weights, x)
        return cross_entropy(logits - tensors["offset"].to(logits.dtype), y, rows), logits
