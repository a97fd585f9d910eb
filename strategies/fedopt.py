"""Adaptive server optimizers (Reddi et al., "Adaptive Federated Optimization", ICLR 2021): the
part they share. With δ_t = x̂ − x_t (the method's step; x̂ its next model) and the first moment

    m_t = β₁·m_{t−1} + (1 − β₁)·δ_t        (m_0 = 0)

each optimizer keeps its second moment v_t its own way (:meth:`FedOpt.second_moment`) and steps
x_{t+1} = x_t + η_t·m_t / (√v_t + τ), η_t its learning rate of the round (:meth:`FedOpt.rate`),
as Flower's ``FedOpt`` strategies compute them, entry by entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedmm.settings import Number, setting
from strategies.server_optimizer import ServerOptimizer, ServerOptimizerSettings


@dataclass
class FedOptSettings(ServerOptimizerSettings):
    """The settings every adaptive server optimizer has (an optimizer's declaration sets its defaults)."""

    eta: float = setting(0.1, Number(gt=0), "η: the server learning rate", label="η {}")
    beta_1: float = setting(0.9, Number(ge=0, lt=1), "β₁ of the first moment")
    beta_2: float = setting(0.99, Number(ge=0, lt=1), "β₂ of the second moment")
    tau: float = setting(1e-3, Number(gt=0), "τ: the adaptivity (added to √v)", label="τ {}")


class FedOpt(ServerOptimizer):
    """The shared step of the adaptive server optimizers (module docstring)."""

    def __init__(self, settings: FedOptSettings | None = None, **changes: Any) -> None:
        super().__init__(settings, **changes)
        self.m: dict[str, np.ndarray] | None = None
        self.v: dict[str, np.ndarray] | None = None

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """v_t from v_{t−1} and δ_t (override this)."""
        raise NotImplementedError

    def rate(self, server_round: int) -> float:
        """η_t (default: η)."""
        return self.eta

    def update(self, server_round: int, x: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        delta = {k: -g for k, g in grads.items()}
        m = self.m or {k: np.zeros_like(d) for k, d in delta.items()}
        v = self.v or {k: np.zeros_like(d) for k, d in delta.items()}
        self.m = {k: self.beta_1 * m[k] + (1 - self.beta_1) * d for k, d in delta.items()}
        self.v = {k: self.second_moment(v[k], d) for k, d in delta.items()}
        eta = self.rate(server_round)
        return {k: value + eta * self.m[k] / (np.sqrt(self.v[k]) + self.tau) for k, value in x.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.m, self.v = state["m"], state["v"]
