"""The mean a method is handed: the one way a method averages client models.

A method never picks its own mean: every aggregate receives a :class:`Mean` (built by the round's
end from the run's settings, :func:`Mean.of`) and asks it for one, so a robust mean that the run
configures (``strategy.defence.robust_mean``) reaches every method alike, and a method that
forgot it cannot exist:

- ``mean(models)``: the unweighted mean (the multi-model methods' global model);
- ``mean(models, weights)``: the weighted mean (FedAvg's ``num-examples`` weights);
- ``mean.weights(updates)``: the weights of a round's updates the run decides (clustered
  sampling's, else each reply's ``num-examples``; equal when none reports examples);
- ``mean.robust``: True when the run replaces the mean by a robust one (median, trimmed); the
  weights are then ignored (they are what an attacker inflates), and a method whose arithmetic
  takes sums of updates (FedDyn's h, SCAFFOLD's c) reads its robust mean instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedmm.protocol import ClientUpdate, ModelDict
from strategies.aggregation import mean_models, robust_mean_models, weighted_mean_models

#: How a round's updates are weighed where the run decides it (the selector's weights), or None.
Weigh = Callable[[list[ClientUpdate]], Sequence[float] | None]


class Mean:
    """The run's mean of client models (module docstring).

    Parameters
    ----------
    how : str
        ``none`` (the plain mean: weighted when weights are given), ``median`` or ``trimmed``
        (coordinate-wise, unweighted).
    trim_fraction : float
        The share of each coordinate's largest and smallest values the trimmed mean leaves out.
    weigh : callable, optional
        The selector's weights of a round's updates (clustered sampling), None to use ``num-examples``.
    """

    def __init__(self, how: str = "none", trim_fraction: float = 0.1, weigh: Weigh | None = None) -> None:
        if how not in ("none", "median", "trimmed"):
            raise ValueError(f"mean {how!r}; allowed: none, median, trimmed")
        self.how, self.trim_fraction, self.weigh = how, float(trim_fraction), weigh

    @classmethod
    def of(cls, defence: Any, weigh: Weigh | None = None) -> Mean:
        """The mean ``strategy.defence`` configures (``robust_mean``, ``trim_fraction``)."""
        return cls(defence.robust_mean, defence.trim_fraction, weigh)

    @property
    def robust(self) -> bool:
        """Whether the run replaces the mean by a robust one (weights then play no part)."""
        return self.how != "none"

    def __call__(self, models: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float] | None = None) -> ModelDict:
        """The mean of ``models``: robust when the run says so, else weighted by ``weights``
        (None: unweighted)."""
        if self.robust:
            return robust_mean_models(models, self.how, self.trim_fraction)
        if weights is None:
            return mean_models(models)
        return weighted_mean_models(models, weights)

    def weights(self, updates: list[ClientUpdate]) -> list[float]:
        """The weights of ``updates`` in a one-model mean: the selector's where it decides them,
        else ``num-examples`` (equal weights when none reports examples)."""
        chosen = self.weigh(updates) if self.weigh is not None else None
        weights = [u.num_examples for u in updates] if chosen is None else list(chosen)
        if sum(weights) <= 0:
            weights = [1.0] * len(updates)
        return list(weights)
