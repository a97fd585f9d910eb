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

from dataclasses import dataclass

from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Bool, Number, setting
from strategies.aggregators import Mean
from strategies.extrapolation import average_iterates, fedexp_step
from strategies.fedavg import FedAvg, FedAvgSettings
from strategies.method import refused

@dataclass
class FedExPSettings(FedAvgSettings):
    """FedExP's server step (Jhunjhunwala et al., ICLR 2023)."""

    option = "fedexp"
    companions = {"objective": "fedexp_original"}
    title = "FedExP"
    epsilon: float = setting(0.001, Number(gt=0), "ε of round 1 (the original: 1e-3 for CIFAR, 0.1 for EMNIST)", paper="1e-3")
    epsilon_decay: float = setting(0.996004, Number(gt=0, le=1), "ε is multiplied by this every round (0.998², as the "
                                   "original); 1.0: constant", paper="0.996004")
    extrapolate_buffers: bool = setting(False, Bool(), "BatchNorm buffers: false = weighted mean (safe); true = "
                                        "extrapolated too (the FedMR port)", label="buffers extrapolated")

    def label_parts(self) -> list[str]:
        constant = [f"ε {self.epsilon} constant"] if self.epsilon_decay == 1.0 else []
        return constant + super().label_parts()

class FedExP(FedAvg):
    """FedExP on the one-model round loop: only :meth:`aggregate` differs from FedAvg.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector
        See :class:`~strategies.base.FedmmStrategy`.
    epsilon : float
        ε of round 1; round r uses ε · epsilon_decay^(r − 1).
    epsilon_decay : float
        Per-round factor of ε (the original: 0.998² = 0.996004; 1.0: constant).
    extrapolate_buffers : bool
        False: BatchNorm buffers are the clients' weighted mean; True: extrapolated with η_g too.
    """

    Settings = FedExPSettings
    global_is_next = False  # it evaluates the mean of the last two iterates
    releases = refused("its server step size is computed from the clients' update norms, which the noise does not cover")

    def epsilon_at(self, server_round: int) -> float:
        """ε of a round."""
        return self.settings.epsilon * self.settings.epsilon_decay ** (server_round - 1)

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        """w^{t+1} = w^t + η_g·Δ̄ becomes the training model; the evaluated model is the mean of
        the last two iterates (round 1: w^1)."""
        if not updates:
            return None
        assert self.models is not None
        current = self.models[0]
        weights = mean.weights(updates)
        epsilon = self.epsilon_at(server_round)
        models = [u.model for u in updates]
        nxt, eta = fedexp_step(current, models, weights, epsilon, self.settings.extrapolate_buffers, mean(models, weights),
                               mean.robust)
        self.round_log.update({"eta_g": eta, "epsilon": epsilon})
        self.models = [nxt]
        return nxt if server_round == 1 else average_iterates(nxt, current)
