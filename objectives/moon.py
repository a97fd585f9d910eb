"""MOON's client (Li, He, Song, CVPR 2021): the model-contrastive objective.

The server is FedAvg (``strategy=moon`` selects it with this objective); the model gets a
projection head (``model.projection_dim`` follows ``objective.projection_dim``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedmm.settings import Choice, Int, Nullable, Number, setting
from fedmm.training import host_values, weighted_sum
from objectives.base import LocalUpdate, ObjectiveSettings, frozen, mu_settings

#: ``Context.state`` ArrayRecord: the model this node finished its last round with.
PREVIOUS = "moon-previous-model"
#: ``Context.state`` MetricRecord: rounds this node has trained with MOON.
AGE_STATE = "moon-age"
#: Reply metric: the mean contrastive loss of the round.
CONTRASTIVE = "moon-contrastive"
#: Reply metric: rounds the node has trained, this one included (1: first, or state lost).
AGE = "moon-rounds"


@dataclass
class MoonSettings(ObjectiveSettings):
    """MOON's loss: CE + μ·ℓ_con on the representation."""

    option = "moon"
    title = "MOON"
    _mu = mu_settings({"cifar10": 5.0, "cifar100": 1.0}, 1.0, "5 (CIFAR-10), 1 (CIFAR-100)")
    mu: float | None = _mu[0]
    mu_by_dataset: dict = _mu[1]
    default_mu: float = _mu[2]
    tau: float = setting(0.5, Number(gt=0), "temperature τ", paper="0.5")
    projection_dim: int | None = setting(256, Nullable(Int(min=1), "null (the classifier's input is the representation) "
                                         "or an integer >= 1"), "the projection head's width (put into the model: "
                                         "model.projection_dim); null: the classifier's input", paper="256")
    first_negative: str = setting("init", Choice("none", "init", "global"), "without a previous local model: none | "
                                  "init (the node's initial network, from round 2) | global")


def contrastive_loss(z: torch.Tensor, z_global: torch.Tensor, z_negatives: list[torch.Tensor], tau: float) -> torch.Tensor:
    """MOON's ℓ_con, batch mean: −log(e^{sim(z,z_g)/τ} / (e^{sim(z,z_g)/τ} + Σ_p e^{sim(z,z_p)/τ})) with
    sim the cosine similarity, computed as the original: cross-entropy over the logits
    [sim(z, z_g), sim(z, z_p1), ...]/τ with target 0 (exactly 0 without a negative)."""
    logits = [F.cosine_similarity(z, z_global, dim=-1)] + [F.cosine_similarity(z, zp, dim=-1) for zp in z_negatives]
    logits = torch.stack(logits, dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


class Moon(LocalUpdate):
    """MOON's client (Li, He, Song, CVPR 2021): CE + μ·ℓ_con on the model's representation (the
    projection head's output when ``projection_dim`` is set, which puts the head into the model:
    ``model.projection_dim``; else the input of the classifier, as FL-bench).

    The positive is the received global model, the negative the model this node finished with
    the last round it took part (kept in ``Context.state``, replaced after each participation);
    both run frozen in eval mode. Without a previous model: ``first_negative: none`` uses no
    negative (ℓ_con = 0, plain CE), ``init`` the node's own untouched initial network (from round
    2 on; round 1 has none, as the original, where a party that never trained contributes its
    random initialisation), ``global`` the received model (ℓ_con = log 2, no gradient, as FL-bench).
    A SuperNode restart loses the previous model (logged; the node continues as at its first
    participation).
    """

    Settings = MoonSettings

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Freeze a copy of the received model and the negative."""
        from fedmm import protocol  # here: the objectives import without Flower

        self.own_state()
        self._mu = self.mu()
        self.tau = float(self.params.tau)
        self.global_model = frozen(copy.deepcopy(model))
        self.negative: nn.Module | None = None
        self.had_previous = PREVIOUS in self.state
        if self.had_previous:
            self.negative = frozen(copy.deepcopy(model))
            previous = protocol.record_to_model(self.state[PREVIOUS])
            self.negative.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in previous.items()})
        else:
            if server_round > 1:
                logging.getLogger("flwr").info(
                    "MOON: no previous model in this node's state at round %d (its first participation, or the "
                    "SuperNode restarted and lost it): first_negative=%s", server_round, self.params.first_negative)
            mode = self.params.first_negative
            if mode == "global":
                self.negative = self.global_model
            elif mode == "init" and server_round > 1:
                self.negative = frozen(self._initial_network(model))
        self.age = int(self.state[AGE_STATE]["rounds"]) if AGE_STATE in self.state else 0
        self._con_terms: list[torch.Tensor] = []  # kept on the device, read once by metrics()

    def _initial_network(self, model: nn.Module) -> nn.Module:
        """This node's own random initialisation (seeded by the run seed and the node)."""
        net = copy.deepcopy(model)
        generator_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(hash((self.run.seed, 0x300, self.node)) % (2**63))
            for module in net.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        finally:
            torch.random.set_rng_state(generator_state)
        return net

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = model.latent(x)
        logits = model.classify(z)
        ce = F.cross_entropy(logits, y)
        if self._mu == 0.0:
            return ce, logits
        with torch.no_grad():
            z_global = self.global_model.latent(x)
            negatives = [self.negative.latent(x)] if self.negative is not None else []
        con = contrastive_loss(z, z_global, negatives, self.tau)
        self._con_terms.append(con.detach())
        return ce + self._mu * con, logits

    def end(self, model: nn.Module) -> dict[str, Any]:
        """Keep the trained model as this node's next negative."""
        from fedmm import protocol  # here: the objectives import without Flower

        from flwr.app import MetricRecord

        self.keep({PREVIOUS: protocol.model_to_record({k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}),
                   AGE_STATE: MetricRecord({"rounds": self.age + 1})})
        return {}

    def metrics(self) -> dict[str, float]:
        """The mean contrastive loss, and how many rounds this node has kept a previous model."""
        terms = self._con_terms
        return {CONTRASTIVE: weighted_sum(host_values(terms)) / max(len(terms), 1), AGE: float(self.age + 1)}
