"""Shared base of the multi-model methods (FedMR, FedCross): K models kept on the server.

Each round the i-th selected node gets model i in its own message (the random sample is the
random dispatch); replies are mapped back to the model they trained by the id of the message
that was sent, and the method turns the K trained models into the K models of the next round
(:meth:`MultiModelStrategy.update_models`).

The global model, used only for evaluation and as the run's final model, is the unweighted mean
of the K trained models, taken before the method's update (as the authors' code does).
"""

from __future__ import annotations

from collections.abc import Sequence

from fedmm.protocol import ClientUpdate, ModelDict
from strategies.aggregation import mean_models
from strategies.base import RoundLoopStrategy
from strategies.selection import ClientSelector


class MultiModelStrategy(RoundLoopStrategy):
    """Keep K models on the server and send a different one to each selected node.

    Parameters
    ----------
    num_models : int
        K: models kept on the server, and clients selected per round.
    seed, fraction_evaluate, selector
        See :class:`~strategies.base.RoundLoopStrategy`.
    """

    def __init__(
        self, num_models: int, seed: int, fraction_evaluate: float = 0.0, selector: ClientSelector | None = None
    ) -> None:
        if num_models < 1:
            raise ValueError(f"num_models must be >= 1, got {num_models}")
        super().__init__(num_models, seed, fraction_evaluate, selector)
        self.num_models = num_models
        self.round_mean: ModelDict | None = None  # set while update_models runs

    # ------------------------------------------------------------------ method hook
    def update_models(self, server_round: int, models: list[ModelDict], trained: list[int]) -> list[ModelDict]:
        """Turn the K models after local training into the K models of the next round.

        ``models[i]`` is the model node i trained (or, for a failed node, the model it was
        given); ``trained`` lists the indices whose training came back. The dicts belong to the
        method: it may reuse their arrays or empty them to save memory (the global model has
        already been taken: ``self.round_mean`` is this round's global model, the unweighted
        mean of ``models``, while ``self.global_model`` is still the previous round's).
        Override this.
        """
        return models

    # ------------------------------------------------------------------ round loop hooks
    def initialize(self, initial: ModelDict) -> None:
        """K references to the initial model (never written in place)."""
        self.models = [initial] * self.num_models
        self.global_model = initial

    def model_for_slot(self, slot: int) -> int:
        """Model i goes to the i-th selected node."""
        return slot

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> ModelDict:
        """Put each trained model back in its slot, take the mean, then apply the method."""
        assert self.models is not None
        updated = [dict(m) for m in self.models]  # the method may empty these dicts; the pool's stay whole
        for update in updates:
            updated[update.slot] = update.model
        global_model = self.round_mean = mean_models(updated)
        self.models = self.update_models(server_round, updated, [u.slot for u in updates])
        self.round_mean = None
        if len(self.models) != self.num_models:
            raise RuntimeError(f"{type(self).__name__}.update_models returned {len(self.models)} models, expected {self.num_models}")
        return global_model

    def pool(self) -> Sequence[ModelDict]:
        """The K models currently kept."""
        return list(self.models or [])
