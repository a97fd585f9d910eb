"""Local objectives: what a client minimises on each batch.

The training loop asks the configured objective for the loss of a batch. An objective sees
the model being trained and may keep state for the round (:meth:`Objective.start_round`),
e.g. a copy of the received model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class Objective:
    """Plain cross-entropy; the base every other objective extends."""

    name = "ce"

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg

    def start_round(self, model: nn.Module, server_round: int) -> None:
        """Called once per round, before training, with the model as received."""

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to minimise, logits) for one batch."""
        logits = model(x)
        return F.cross_entropy(logits, y), logits


#: objective name -> class
OBJECTIVES: dict[str, type[Objective]] = {"ce": Objective}


def build_objective(cfg: Mapping[str, Any]) -> Objective:
    """The objective named by ``objective.name`` (default ``ce``)."""
    name = cfg.get("objective", {}).get("name", "ce")
    return OBJECTIVES[name](cfg)
