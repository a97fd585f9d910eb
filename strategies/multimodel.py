"""Shared base of the multi-model methods (FedMR, FedCross, FedMut): K models kept on the server.

Each round the i-th selected node gets model i in its own message (the random sample is the
random dispatch); replies are mapped back to the model they trained by the id of the message
that was sent, and the method turns the K trained models into the K models of the next round
(:meth:`MultiModel.update_models`). The same arithmetic serves the synchronous round and the
asynchronous one, which applies it to the B models that came back.

The global model, used only for evaluation and as the run's final model, is the unweighted mean
of the K trained models, taken before the method's update (as the authors' code does).

With ``strategy.log_model_cosine=true`` every round also logs how alike the trained models are
(FedMR KDD'24, Fig. 6: "the average cosine similarity between all the intermediate models"):
``model_cosine`` (mean over pairs),
``model_cosine_min`` and ``model_cosine_max`` in ``round_log``, hence in the round's row of
``metrics.jsonl``. It is taken over the models whose training came back this round, before the
method's update (recombination, cross-aggregation, mutation) changes them; plot it with
``python -m analysis.figures cosine <run dir>...``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Bool, setting
from strategies.aggregators import Mean
from strategies.cross_aggregation import _float_keys, _gram
from strategies.method import MODELS, PER_NODE, Method
from strategies.selection import ClientSelector
from strategies.strategy_settings import StrategySettings


def pairwise_cosine(models: Sequence[Mapping[str, np.ndarray]], block_bytes: int = 64 << 20) -> np.ndarray:
    """K × K cosine similarity of the models, each flattened to one vector, in float64.

    The vector of a model is its floating-point state_dict entries in order: weights and
    floating buffers (BatchNorm running statistics); integer buffers (``num_batches_tracked``)
    are left out. The Gram matrix is FedCross's blocked one
    (:func:`strategies.cross_aggregation._gram`: one reusable buffer of at most ``block_bytes``,
    no flattened model ever built; O(K²·N) multiply-adds), with the products in float64. (FedCross's
    partner selection, :func:`strategies.cross_aggregation.model_similarity`, computes the same
    in the models' own dtype; float64 here keeps values close to 1 apart, e.g. 0.9999 vs 0.99995.)
    A model whose vector is zero has similarity NaN (undefined) with every model.
    """
    keys = _float_keys(models[0]) if models else []
    gram = _gram(models, keys, block_bytes, dtype=np.float64)
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    denom = np.outer(norms, norms)
    cosine = np.divide(gram, denom, out=np.full_like(gram, np.nan), where=denom > 0)
    return np.clip(cosine, -1.0, 1.0)  # rounding can leave |cos| a hair above 1


def cosine_summary(models: Sequence[Mapping[str, np.ndarray]]) -> dict[str, float]:
    """``model_cosine`` (mean over the K(K−1)/2 pairs), ``model_cosine_min`` and
    ``model_cosine_max`` of :func:`pairwise_cosine`; empty for fewer than two models."""
    if len(models) < 2:
        return {}
    pairs = pairwise_cosine(models)[np.triu_indices(len(models), k=1)]
    return {"model_cosine": float(pairs.mean()), "model_cosine_min": float(pairs.min()), "model_cosine_max": float(pairs.max())}


@dataclass
class MultiModelSettings(StrategySettings):
    """Settings every multi-model method has (a method's own declaration extends this one)."""

    log_model_cosine: bool = setting(False, Bool(), "log model_cosine, the mean pairwise cosine similarity of the "
                                     "round's trained models (with _min and _max), every round (FedMR Fig. 6: "
                                     "fedmm-figures cosine); costs about K²·N/2 multiply-adds for N parameters, "
                                     "0.09 s of a 2.4 s round at K = 10 cnn on 2 cores")
    #: Declared after runs were made: the values that reproduce those runs (they logged it).
    added = {"log_model_cosine": True}


class MultiModel(Method):
    """K models on the server, a different one to each selected node (model i to the i-th).

    Parameters
    ----------
    clients_per_round : int
        K: clients selected per round, and models kept on the server (one per selected client).
    seed, fraction_evaluate, selector, settings, changes
        See :class:`~strategies.base.FedmmStrategy`.
    """

    holds = PER_NODE
    releases = MODELS  # under DP: the K trained models, noised; recombination, fusion, mutation are post-processing

    Settings = MultiModelSettings

    def __init__(self, clients_per_round: int | None = None, seed: int = 0, fraction_evaluate: float | None = None,
                 selector: ClientSelector | None = None, **settings: Any) -> None:
        super().__init__(clients_per_round, seed, fraction_evaluate, selector, **settings)
        self.round_mean: ModelDict | None = None  # set while update_models runs

    # ------------------------------------------------------------------ the method's operation
    def update_models(self, server_round: int, models: list[ModelDict], trained: list[int]) -> list[ModelDict]:
        """Turn the models after local training into the models of the next round (override this).

        ``models`` are the round's models (all K; in an asynchronous round the B that came
        back): each the model its node trained or, for a failed node, the model it was given;
        ``trained`` lists the positions (in ``models``) whose training came back. The dicts
        belong to the method: it may reuse their arrays or empty them to save memory (the global
        model has already been taken: ``self.round_mean`` is this round's global model, the mean
        of the K models, while ``self.global_model`` is still the previous round's).
        """
        return models

    # ------------------------------------------------------------------ the method's hooks
    def initialize(self, initial: ModelDict) -> None:
        """K references to the initial model (never written in place); model i goes to the i-th
        selected node. Under differential privacy's grouped releases G models (``privacy.groups``),
        model i mod G to the i-th selected node."""
        self.models = [initial] * self.settings.privacy.models_kept(self.clients_per_round)
        self.global_model = initial

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict:
        """Put each trained model back in its slot, take the mean of the K models (the global
        model, before the method changes them), log how alike the trained models are, then apply
        the method (:meth:`update_models`) to the models taking part: those of ``updates``, one
        per model of the round (all K in a synchronous round; a model whose node sent no usable
        update comes untrained, as it was sent: ``update.trained`` False)."""
        assert self.models is not None
        updated = [dict(m) for m in self.models]  # the method may empty these dicts; the pool's stay whole
        for update in updates:
            updated[update.slot] = update.model
        trained_models = [update.model for update in updates if update.trained]
        if self.settings.log_model_cosine:  # the models that came back trained; a failed slot's model is left out
            self.round_log.update(cosine_summary(trained_models))
        global_model = self.round_mean = mean(updated)
        members = sorted(update.slot for update in updates)
        trained = {update.slot for update in updates if update.trained}
        fused = self.update_models(server_round, [updated[i] for i in members],
                                   [position for position, i in enumerate(members) if i in trained])
        self.round_mean = None
        if len(fused) != len(members):
            raise RuntimeError(f"{type(self).__name__}.update_models returned {len(fused)} models, expected {len(members)}")
        models = list(self.models)
        for index, model in zip(members, fused):
            models[index] = model
        self.models = models
        return global_model

    def pool(self) -> Sequence[ModelDict]:
        """The K models currently kept."""
        return list(self.models or [])
