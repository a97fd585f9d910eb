"""FedAvgM: server momentum (Hsu, Qi, Brown, 2019), as a server optimizer any one-model method takes.

With Δ_t = x_t − x̂ (the pseudo-gradient: the method's next model x̂), momentum β and server
learning rate η (PyTorch's SGD convention, no dampening, as Flower's ``FedAvgM``):

    v_t = β·v_{t−1} + Δ_t   (v_1 = Δ_1)        x_{t+1} = x_t − η·v_t

Flower's defaults: η = 1, β = 0 (the method's own step). ``server_optimizer=fedavgm
server_optimizer.server_momentum=0.9`` turns it on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedmm.settings import Number, setting
from strategies.server_optimizer import ServerOptimizer, ServerOptimizerSettings


@dataclass
class FedAvgMSettings(ServerOptimizerSettings):
    """FedAvgM's server learning rate and momentum (Flower's names and defaults)."""

    option = "fedavgm"
    title = "FedAvgM"
    server_learning_rate: float = setting(1.0, Number(gt=0), "η: x_{t+1} = x_t − η·v_t", label="η {}")
    server_momentum: float = setting(0.0, Number(ge=0, lt=1), "β: v_t = β·v_{t−1} + Δ_t", paper="0.9 (Hsu et al.)",
                                     label="β {}")


class FedAvgM(ServerOptimizer):
    """Server momentum (module docstring)."""

    Settings = FedAvgMSettings

    def __init__(self, settings: FedAvgMSettings | None = None, **changes: Any) -> None:
        super().__init__(settings, **changes)
        self.momentum: dict[str, np.ndarray] | None = None

    def update(self, server_round: int, x: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.server_momentum > 0.0:
            if self.momentum is None:
                self.momentum = grads
            else:
                self.momentum = {k: self.server_momentum * v + grads[k] for k, v in self.momentum.items()}
            grads = self.momentum
        return {k: value - self.server_learning_rate * grads[k] for k, value in x.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self.momentum}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.momentum = state["momentum"]
