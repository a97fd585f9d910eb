"""Local objectives: what a client minimises on each batch, selected by ``objective.name``.

The training loop calls :meth:`Objective.start_round` once with the model as received, then
asks :meth:`Objective.loss` for the loss of every batch. An objective reads as its difference
from plain cross-entropy; a new one (MOON, SCAFFOLD, ASAM, ...) is a subclass registered in
:data:`OBJECTIVES`, and its defaults go in ``conf/objective/<name>.yaml``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fedmm.errors import ConfigError


class Objective:
    """Plain cross-entropy; the base every other objective extends.

    Parameters
    ----------
    cfg : Mapping
        The run's resolved config (``objective``, ``dataset``, ... groups).
    """

    name = "ce"

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.params: Mapping[str, Any] = cfg.get("objective", {"name": "ce"})

    def start_round(self, model: nn.Module, server_round: int) -> None:
        """Called once per round, before training, with the model as received."""

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to minimise, logits) for one batch."""
        logits = model(x)
        return F.cross_entropy(logits, y), logits

    def mu(self) -> float:
        """μ of the objective: ``objective.mu``, or the paper's value for the dataset."""
        return resolve_mu(self.params, self.cfg["dataset"]["name"])


def resolve_mu(params: Mapping[str, Any], dataset: str) -> float:
    """``mu`` when set, else ``mu_by_dataset[dataset]``, else ``default_mu``."""
    if params.get("mu") is not None:
        return float(params["mu"])
    return float(params.get("mu_by_dataset", {}).get(dataset, params.get("default_mu", 0.0)))


class FedProx(Objective):
    """CE + (μ/2)·‖w − w_global‖² over all trainable parameters (Li et al. 2020, Eq. 2)."""

    name = "fedprox"

    def start_round(self, model: nn.Module, server_round: int) -> None:
        """Keep a detached copy of the received parameters."""
        self.global_params = [p.detach().clone() for p in model.parameters()]
        self._mu = self.mu()

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ce, logits = super().loss(model, x, y)
        if self._mu == 0.0:
            return ce, logits
        prox = sum(((p - g) ** 2).sum() for p, g in zip(model.parameters(), self.global_params))
        return ce + 0.5 * self._mu * prox, logits


class FedRL(Objective):
    """Review learning (Wang et al. 2024, Algorithm 1 and Eq. 3).

    loss = CE + (μ/2)·‖kr_m − kr_{i,m}‖₂, where kr_m is the output of the first m layers of the
    received model (frozen, in eval mode, never updated) and kr_{i,m} that of the local model on
    the same batch. The review depth m cycles through 1..M (M = the model's ``num_layers``):
    batch by batch starting at 1 every round (``advance: batch``, Algorithm 1), or one depth per
    round (``advance: round``).
    """

    name = "fedrl"

    def start_round(self, model: nn.Module, server_round: int) -> None:
        """Freeze a copy of the received model; reset the review depth."""
        self.reference = copy.deepcopy(model).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)
        self.num_layers = int(model.num_layers)
        self.server_round = server_round
        self.batches_seen = 0
        self._mu = self.mu()

    def review_depth(self) -> int:
        """m for the next batch, in 1..M."""
        if self.params.get("advance", "batch") == "round":
            return (self.server_round - 1) % self.num_layers + 1
        return self.batches_seen % self.num_layers + 1

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.review_depth()
        self.batches_seen += 1
        # one pass through the local model gives both kr_{i,m} and the logits
        h, kr_local = x, None
        for depth, layer in enumerate(model.layers, start=1):
            h = layer(h)
            if depth == m:
                kr_local = h
        logits = h
        ce = F.cross_entropy(logits, y)
        if self._mu == 0.0:
            return ce, logits
        with torch.no_grad():
            kr_global = self.reference.forward_prefix(x, m)
        review = torch.linalg.vector_norm(kr_global - kr_local)
        return ce + 0.5 * self._mu * review, logits


#: objective.name -> class
OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (Objective, FedProx, FedRL)}


def build_objective(cfg: Mapping[str, Any]) -> Objective:
    """The objective named by ``objective.name`` (default ``ce``)."""
    name = cfg.get("objective", {}).get("name", "ce")
    return OBJECTIVES[name](cfg)


def validate_objective_config(cfg: Mapping[str, Any]) -> None:
    """Check the ``objective`` group before any training starts."""
    params = cfg.get("objective", {"name": "ce"})
    name = params.get("name")
    if name not in OBJECTIVES:
        raise ConfigError("objective.name", name, ", ".join(OBJECTIVES))
    if name == "ce":
        return
    mu = resolve_mu(params, cfg["dataset"]["name"])
    if params.get("mu") is not None and (isinstance(params["mu"], bool) or not isinstance(params["mu"], (int, float)) or params["mu"] < 0):
        raise ConfigError("objective.mu", params["mu"], "null (the paper's value for the dataset) or a number >= 0")
    if mu < 0:
        raise ConfigError("objective.mu_by_dataset", params.get("mu_by_dataset"), "numbers >= 0")
    if name == "fedrl" and params.get("advance", "batch") not in ("batch", "round"):
        raise ConfigError("objective.advance", params.get("advance"), "batch, round")
