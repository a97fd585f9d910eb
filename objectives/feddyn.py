"""FedDyn's client (Acar et al., ICLR 2021): the dynamic regularizer in the local loss.

With θ the received server model and g_k this client's linear term (kept in ``Context.state``;
zeros at its first round, and after a SuperNode restart, which is logged), the client minimises

    L_k(θ_k) − ⟨g_k, θ_k⟩ + (α/2)·‖θ_k − θ‖²

over its trainable parameters, then updates g_k ← g_k − α·(θ_k − θ) (:func:`feddyn_client_step`).
α is the strategy's (``strategy.alpha``): ``strategy=feddyn`` selects this objective.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from objectives.base import LocalUpdate, ObjectiveSettings, parameters

#: ``Context.state`` ArrayRecord: this client's linear term g_k (one array per trainable parameter).
GRADIENT_STATE = "feddyn-gradient"


def feddyn_client_step(g: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray], server: Mapping[str, np.ndarray],
                       alpha: float) -> dict[str, np.ndarray]:
    """g_k ← g_k − α·(θ_k − θ), key by key."""
    return {k: (g[k] - alpha * (trained[k] - server[k])).astype(g[k].dtype) for k in g}


@dataclass
class FedDynClientSettings(ObjectiveSettings):
    """No settings of its own: α is ``strategy.alpha``."""

    option = "feddyn"
    title = "FedDyn"

    server = "feddyn"


class FedDynClient(LocalUpdate):
    """FedDyn's local objective (see the module docstring)."""

    Settings = FedDynClientSettings

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Keep θ; load g_k (zeros the first time)."""
        from fedmm import protocol  # here: the objectives import without Flower

        self.own_state()
        self.alpha = float(self.run.strategy.alpha)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.server = {n: p.detach().clone() for n, p in named}
        if GRADIENT_STATE in self.state:
            g = protocol.record_to_model(self.state[GRADIENT_STATE])
        else:
            g = {n: torch.zeros_like(p, device="cpu").numpy() for n, p in named}
            if server_round > 1:
                logging.getLogger("flwr").info("FedDyn: no linear term in this node's state at round %d (its first "
                                               "participation, or the SuperNode restarted and lost it)", server_round)
        device = named[0][1].device if named else torch.device("cpu")
        self.g = {n: torch.from_numpy(np.array(g[n])).to(device) for n, _ in named}

    def tensors(self) -> dict[str, torch.Tensor]:
        """g_k (``g.<name>``) and θ (``server.<name>``)."""
        return {**{f"g.{n}": v for n, v in self.g.items()}, **{f"server.{n}": v for n, v in self.server.items()}}

    def batch_loss(self, model: nn.Module, weights: Mapping[str, torch.Tensor] | None, tensors: Mapping[str, torch.Tensor],
                   x: torch.Tensor, y: torch.Tensor, index: int, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ce, logits = super().batch_loss(model, weights, tensors, x, y, index, rows)
        linear = torch.zeros((), device=logits.device, dtype=logits.dtype)
        prox = torch.zeros((), device=logits.device, dtype=logits.dtype)
        for name, p in parameters(model, weights).items():
            if name in self.g:
                linear = linear + (tensors[f"g.{name}"] * p).sum()
                prox = prox + ((p - tensors[f"server.{name}"]) ** 2).sum()
        return ce - linear + 0.5 * self.alpha * prox, logits

    def end(self, model: nn.Module) -> dict[str, Any]:
        """g_k ← g_k − α(θ_k − θ) into the node's state; nothing extra in the reply."""
        from fedmm import protocol  # here: the objectives import without Flower

        trained = {n: p.detach().cpu().numpy() for n, p in model.named_parameters() if n in self.g}
        new = feddyn_client_step({n: v.cpu().numpy() for n, v in self.g.items()}, trained,
                                 {n: v.cpu().numpy() for n, v in self.server.items()}, self.alpha)
        self.keep({GRADIENT_STATE: protocol.model_to_record(new)})
        return {}
