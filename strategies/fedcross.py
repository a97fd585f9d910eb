"""FedCross: multi-model cross-aggregation (Hu et al.), with the paper's acceleration.

Round r, after the K middleware models come back:

1. ``r ≤ first_stage_rounds``: plain aggregation, every model reset to the mean (as FedMR);
2. ``r ≤ first_stage_rounds + propeller_rounds``: propeller models — each model is fused
   with its ``num_propellers`` in-order partners: w_j ← α_p·w_j + (1−α_p)·mean(partners);
3. afterwards: collaborative-model selection and w_j ← α(r)·w_j + (1−α(r))·w_c(j), where α(r)
   follows the dynamic-α schedule for ``dynamic_alpha_rounds`` rounds, then stays at ``alpha``.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from typing import Any

from flwr.supercore import log

from fedmm.config import Choice, Int, Number
from fedmm.protocol import ModelDict
from strategies.aggregation import mean_models
from strategies.multimodel import MultiModelStrategy
from strategies.selection import ClientSelector
from strategies.cross_aggregation import (
    SELECTIONS,
    SIMILARITIES,
    collaborative_models,
    cross_aggregate,
    dynamic_alpha,
    model_similarity,
    propellers,
)

#: Keys of the ``strategy`` config group of FedCross (defaults in conf/strategy/fedcross.yaml).
CONFIG_SCHEMA = {
    "fraction_evaluate": Number(ge=0.0, le=1.0),
    "alpha": Number(ge=0, le=1),
    "selection": Choice(*SELECTIONS),
    "similarity": Choice(*SIMILARITIES),
    "first_stage_rounds": Int(min=0),
    "propeller_rounds": Int(min=0),
    "num_propellers": Int(min=1),
    "propeller_alpha": Number(ge=0, le=1),
    "dynamic_alpha_rounds": Int(min=0),
}


class FedCross(MultiModelStrategy):
    """FedCross on the multi-model base: only :meth:`update_models` differs.

    Parameters
    ----------
    num_models, seed, fraction_evaluate, selector
        See :class:`~strategies.multimodel.MultiModelStrategy`.
    alpha : float
        Fusion weight of the model itself (paper: 0.99).
    selection : str
        ``lowest-similarity`` (default), ``highest-similarity`` or ``in-order``.
    similarity : str
        ``model`` (one cosine over all weights, the paper) or ``chunked`` (sum of cosines
        over chunks of two tensors, the authors' code).
    first_stage_rounds : int
        Rounds of plain aggregation first.
    propeller_rounds, num_propellers, propeller_alpha
        Propeller-model acceleration: for ``propeller_rounds`` rounds after the first stage,
        fuse each model with ``num_propellers`` in-order partners at weight ``propeller_alpha``.
    dynamic_alpha_rounds : int
        Dynamic-α acceleration: α rises linearly from 0.5 to ``alpha`` over this many rounds
        (after the propeller rounds); 0 disables it.
    """

    writable_updates = True  # cross-aggregation writes the fused values into the trained models' arrays

    def __init__(
        self,
        num_models: int,
        seed: int,
        fraction_evaluate: float = 0.0,
        alpha: float = 0.99,
        selection: str = "lowest-similarity",
        similarity: str = "model",
        first_stage_rounds: int = 0,
        propeller_rounds: int = 0,
        num_propellers: int = 2,
        propeller_alpha: float = 0.5,
        dynamic_alpha_rounds: int = 0,
        selector: ClientSelector | None = None,
    ) -> None:
        super().__init__(num_models, seed, fraction_evaluate, selector)
        self.alpha = alpha
        self.selection = selection
        self.similarity = similarity
        self.first_stage_rounds = first_stage_rounds
        self.propeller_rounds = propeller_rounds
        self.num_propellers = num_propellers
        self.propeller_alpha = propeller_alpha
        self.dynamic_alpha_rounds = dynamic_alpha_rounds
        self.last_alpha: float | None = None

    def alpha_at(self, server_round: int) -> float:
        """α of a cross-aggregation round (dynamic α, then the threshold)."""
        start = self.first_stage_rounds + self.propeller_rounds
        return dynamic_alpha(server_round, self.alpha, self.dynamic_alpha_rounds, start_round=start)

    def update_models(self, server_round: int, models: list[ModelDict], trained: list[int]) -> list[ModelDict]:
        """Stage 1 reset, propeller fusion, or cross-aggregation (see the module docstring)."""
        if server_round <= self.first_stage_rounds:
            return [mean_models(models)] * self.num_models
        if server_round <= self.first_stage_rounds + self.propeller_rounds:
            self.last_alpha = self.propeller_alpha
            return cross_aggregate(models, propellers(self.num_models, self.num_propellers), self.propeller_alpha, consume=True)
        sim = None if self.selection == "in-order" else model_similarity(models, self.similarity)
        partners = collaborative_models(sim, self.selection, server_round, self.num_models)
        self.last_alpha = self.alpha_at(server_round)
        # the trained models are not needed afterwards: cross_aggregate releases them key by key
        return cross_aggregate(models, partners, self.last_alpha, consume=True)

    def state_dict(self) -> dict:
        """The base state plus the α of the last fusion."""
        return {**super().state_dict(), "last_alpha": self.last_alpha}

    def load_state_dict(self, state) -> None:  # noqa: ANN001 - see the base
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self.last_alpha = state.get("last_alpha")

    def summary(self) -> None:
        """Log the strategy's settings."""
        super().summary()
        log(
            INFO,
            "\t    alpha=%.3f selection=%s similarity=%s first_stage=%d propellers=%d×%d dynamic_alpha_rounds=%d",
            self.alpha,
            self.selection,
            self.similarity,
            self.first_stage_rounds,
            self.propeller_rounds,
            self.num_propellers,
            self.dynamic_alpha_rounds,
        )


def from_config(cfg: Mapping[str, Any]) -> FedCross:
    """Build FedCross from the resolved run config."""
    s = cfg["strategy"]
    return FedCross(
        num_models=cfg["clients_per_round"],
        seed=cfg["seed"],
        fraction_evaluate=s["fraction_evaluate"],
        alpha=s["alpha"],
        selection=s["selection"],
        similarity=s["similarity"],
        first_stage_rounds=s["first_stage_rounds"],
        propeller_rounds=s["propeller_rounds"],
        num_propellers=s["num_propellers"],
        propeller_alpha=s["propeller_alpha"],
        dynamic_alpha_rounds=s["dynamic_alpha_rounds"],
    )
