"""FedExP: adaptive server step sizes from extrapolation (Jhunjhunwala et al., ICLR 2023).

One model trains (sent to every selected client, as FedAvg); after each round the server steps
η_g ≥ 1 times the clients' weighted mean update (:func:`strategies.extrapolation.fedexp_step`).
The model evaluated and saved is the mean of the last two iterates, (w^{t+1} + w^t) / 2 (in the
first round, w^1), while training goes on from w^{t+1}. η_g and ε of each round go into
``metrics.jsonl`` (``eta_g``, ``epsilon``).

Presets: ``fedexp`` (the original code: ε = 1e-3, ×0.998² per round, buffers averaged) and
``fedexp_fedmr_repo`` (the FedMR authors' port: ε = 0.1 constant, the whole state_dict
extrapolated).
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from typing import Any

from flwr.supercore import log

from fedmm.config import Bool, Number
from fedmm.protocol import ClientUpdate, ModelDict
from strategies.extrapolation import average_iterates, fedexp_step
from strategies.fedavg import FedAvg
from strategies.selection import ClientSelector

#: Keys of the ``strategy`` config group of FedExP (defaults in conf/strategy/fedexp.yaml).
CONFIG_SCHEMA = {
    "fraction_evaluate": Number(ge=0.0, le=1.0),
    "epsilon": Number(gt=0),
    "epsilon_decay": Number(gt=0, le=1),
    "extrapolate_buffers": Bool(),
}


class FedExP(FedAvg):
    """FedExP on the one-model round loop: only :meth:`aggregate` differs from FedAvg.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector
        See :class:`~strategies.base.RoundLoopStrategy`.
    epsilon : float
        ε of round 1; round r uses ε · epsilon_decay^(r − 1).
    epsilon_decay : float
        Per-round factor of ε (the original: 0.998² = 0.996004; 1.0: constant).
    extrapolate_buffers : bool
        False: BatchNorm buffers are the clients' weighted mean; True: extrapolated with η_g too.
    """

    def __init__(
        self,
        clients_per_round: int,
        seed: int,
        fraction_evaluate: float = 0.0,
        epsilon: float = 1e-3,
        epsilon_decay: float = 0.998**2,
        extrapolate_buffers: bool = False,
        selector: ClientSelector | None = None,
    ) -> None:
        super().__init__(clients_per_round, seed, fraction_evaluate, selector)
        self.epsilon = float(epsilon)
        self.epsilon_decay = float(epsilon_decay)
        self.extrapolate_buffers = bool(extrapolate_buffers)

    def epsilon_at(self, server_round: int) -> float:
        """ε of a round."""
        return self.epsilon * self.epsilon_decay ** (server_round - 1)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> ModelDict | None:
        """w^{t+1} = w^t + η_g·Δ̄ becomes the training model; the evaluated model is the mean of
        the last two iterates (round 1: w^1)."""
        if not updates:
            return None
        assert self.models is not None
        current = self.models[0]
        weights = self.update_weights(updates)
        epsilon = self.epsilon_at(server_round)
        nxt, eta = fedexp_step(current, [u.model for u in updates], weights, epsilon, self.extrapolate_buffers)
        self.round_log.update({"eta_g": eta, "epsilon": epsilon})
        self.models = [nxt]
        return nxt if server_round == 1 else average_iterates(nxt, current)

    def summary(self) -> None:
        """Log the strategy's settings."""
        super().summary()
        log(INFO, "\t    epsilon=%g epsilon_decay=%g extrapolate_buffers=%s", self.epsilon, self.epsilon_decay,
            self.extrapolate_buffers)


def from_config(cfg: Mapping[str, Any]) -> FedExP:
    """Build FedExP from the resolved run config."""
    s = cfg["strategy"]
    return FedExP(
        clients_per_round=cfg["clients_per_round"],
        seed=cfg["seed"],
        fraction_evaluate=s["fraction_evaluate"],
        epsilon=s["epsilon"],
        epsilon_decay=s["epsilon_decay"],
        extrapolate_buffers=s["extrapolate_buffers"],
    )
