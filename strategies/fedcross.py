"""FedCross: multi-model cross-aggregation (Hu et al.), with the paper's acceleration.

Round r, after the K middleware models come back:

1. ``r ≤ first_stage_rounds``: plain aggregation, every model reset to the mean (as FedMR);
2. ``r ≤ first_stage_rounds + propeller_rounds``: propeller models — each model is fused
   with its ``num_propellers`` in-order partners: w_j ← α_p·w_j + (1−α_p)·mean(partners);
3. afterwards: collaborative-model selection and w_j ← α(r)·w_j + (1−α(r))·w_c(j), where α(r)
   follows the dynamic-α schedule for ``dynamic_alpha_rounds`` rounds, then stays at ``alpha``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedmm.settings import Choice, Int, Number, setting
from fedmm.protocol import ModelDict
from strategies.aggregation import mean_models
from strategies.method import ASYNC, SYNC
from strategies.multimodel import MultiModel, MultiModelSettings
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

@dataclass
class FedCrossSettings(MultiModelSettings):
    """FedCross's settings (paper Section III; acceleration Section III-D, off by default)."""

    option = "fedcross"
    title = "FedCross"
    alpha: float = setting(0.99, Number(ge=0, le=1), "weight of the model itself in w_j <- alpha*w_j + (1-alpha)*w_c(j)",
                           paper="0.99", label="α {}")
    selection: str = setting("lowest-similarity", Choice(*SELECTIONS), "how each model's collaborative model is chosen",
                             paper="lowest-similarity", label="{}")
    similarity: str = setting("model", Choice(*SIMILARITIES), "model: one cosine over all weights (paper) | chunked: "
                              "sum over 2-tensor chunks (authors' code)", label="{} similarity")
    first_stage_rounds: int = setting(0, Int(min=0), "rounds of plain aggregation first", label="first stage {}")
    propeller_rounds: int = setting(0, Int(min=0), "rounds in which each model is fused with num_propellers in-order partners")
    num_propellers: int = setting(2, Int(min=1), "partners of each model in a propeller round")
    propeller_alpha: float = setting(0.5, Number(ge=0, le=1), "weight of the model itself during the propeller rounds")
    dynamic_alpha_rounds: int = setting(0, Int(min=0), "alpha rises linearly from 0.5 to `alpha` over this many rounds "
                                        "(after the propeller rounds)")

    #: The asynchronous FedCross was an option of its own: FedCross with the asynchronous driver.
    renamed = {"fedcross_async": {"asynchronous": {"enabled": True}}}

    def label_parts(self) -> list[str]:
        parts = super().label_parts()
        if self.propeller_rounds or self.dynamic_alpha_rounds:
            parts.append(f"PM {self.propeller_rounds} + DA {self.dynamic_alpha_rounds}")
        return parts

class FedCross(MultiModel):
    """FedCross on the multi-model base: only :meth:`update_models` differs.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector
        See :class:`~strategies.multimodel.MultiModel`.
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

    Settings = FedCrossSettings
    drivers = (SYNC, ASYNC)

    def __init__(self, clients_per_round: int | None = None, seed: int = 0, fraction_evaluate: float | None = None,
                 selector: ClientSelector | None = None, **settings: Any) -> None:
        super().__init__(clients_per_round, seed, fraction_evaluate, selector, **settings)
        self.last_alpha: float | None = None

    def alpha_at(self, server_round: int) -> float:
        """α of a cross-aggregation round (dynamic α, then the threshold)."""
        s = self.settings
        return dynamic_alpha(server_round, s.alpha, s.dynamic_alpha_rounds, start_round=s.first_stage_rounds + s.propeller_rounds)

    def update_models(self, server_round: int, models: list[ModelDict], trained: list[int]) -> list[ModelDict]:
        """Stage 1 reset, propeller fusion, or cross-aggregation (see the module docstring), among
        the models given (all K; the asynchronous FedCross gives the B that came back)."""
        k, s = len(models), self.settings
        if server_round <= s.first_stage_rounds:
            return [mean_models(models)] * k
        if server_round <= s.first_stage_rounds + s.propeller_rounds:
            self.last_alpha = s.propeller_alpha
            return cross_aggregate(models, propellers(k, s.num_propellers), s.propeller_alpha, consume=True)
        sim = None if s.selection == "in-order" else model_similarity(models, s.similarity)
        partners = collaborative_models(sim, s.selection, server_round, k)
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
