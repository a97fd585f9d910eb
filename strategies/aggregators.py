"""The mean a method is handed: the one way a method averages client models.

A method never picks its own mean: every aggregate receives a :class:`Mean` (built by the round's
end from the run's settings, :func:`Mean.of`) and asks it for one, so the aggregator the run
configures (``strategy.defence.aggregator``, after ``strategy.defence.pre_aggregators``) reaches
every method alike, and a method that forgot it cannot exist:

- ``mean(models)``: the unweighted mean (the multi-model methods' global model);
- ``mean(models, weights)``: the weighted mean (FedAvg's ``num-examples`` weights);
- ``mean(deltas, deltas=True)``: the same of vectors that are already differences (FedBuff's
  staleness-weighted updates, SCAFFOLD's control-variate deltas);
- ``mean.weights(updates)``: the weights of a round's updates the run decides (clustered
  sampling's, else each reply's ``num-examples``; equal when none reports examples);
- ``mean.robust``: True when the run replaces the mean by a robust aggregator; the weights are
  then ignored (they are what an attacker inflates), and a method whose arithmetic takes sums of
  updates (FedDyn's h, SCAFFOLD's c) reads its robust mean instead.

The robust aggregators and pre-aggregators are the Byzantine-robustness library byzfl's (EPFL
DCL and INRIA WIDE): :data:`AGGREGATORS` and :data:`PRE_AGGREGATORS` name them as the config does.
They act on each model's floating entries flattened into one vector, taken as the difference to
the round's reference (the model the updates were sent; ``deltas=True``: as given), so that the
norm-based ones (clipping, ARC, centered clipping) bound updates, not models; the result is added
back to the reference. Integer entries (BatchNorm's batch counters) take the coordinate-wise
median. ``f`` (the hostile nodes tolerated) goes to every one that takes it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedmm.protocol import ClientUpdate, ModelDict
from strategies.aggregation import mean_models, weighted_mean_models

#: How a round's updates are weighed (the round's weighting stage decides it: strategies/stages.py).
Weigh = Callable[[list[ClientUpdate]], Sequence[float]]


def weights_of(updates: Sequence[ClientUpdate], chosen: Sequence[float] | None = None) -> list[float]:
    """The weights of ``updates`` in a one-model mean: ``chosen`` (a selector's) where given, else
    ``num-examples``; equal weights when they sum to nothing (no update reports examples)."""
    weights = [u.num_examples for u in updates] if chosen is None else [float(w) for w in chosen]
    return weights if sum(weights) > 0 else [1.0] * len(updates)

#: config name -> byzfl's aggregator class. Left out: MoNNA, which needs a trusted vector (the
#: server's own update) that a federation's server does not have.
AGGREGATORS = {"average": "Average", "median": "Median", "trmean": "TrMean", "geometric_median": "GeometricMedian",
               "krum": "Krum", "multikrum": "MultiKrum", "centered_clipping": "CenteredClipping", "mda": "MDA",
               "meamed": "Meamed", "caf": "CAF", "smea": "SMEA"}
#: config name -> byzfl's pre-aggregator class (each maps n vectors to n, or to ⌈n/s⌉ buckets).
PRE_AGGREGATORS = {"nnm": "NNM", "bucketing": "Bucketing", "clipping": "Clipping", "arc": "ARC"}
#: The names whose byzfl class takes ``f`` (tests/test_aggregators.py holds this to byzfl's
#: signatures; kept here so that validating a config does not import byzfl).
TAKES_F = ("trmean", "krum", "multikrum", "mda", "meamed", "caf", "smea", "nnm", "arc")
#: The aggregators that search the subsets of n − f vectors: C(n, f) of them per call.
SUBSET_SEARCH = ("mda", "smea")
#: The largest C(n, f) a subset search is allowed (10⁵ subsets of a VGG-16 take minutes).
MAX_SUBSETS = 100_000


class AggregationRefused(ValueError):
    """The configured aggregator cannot take this round's updates (too few for its ``f``): the
    round aggregates nothing (:func:`strategies.rounds.end` keeps the models)."""


def byzfl_chain(aggregator: str, pre_aggregators: Sequence[str], f: int, bucket_size: int = 2,
                clip_threshold: float = 2.0) -> tuple[list[Any], Any]:
    """byzfl's pre-aggregator objects and aggregator object for these settings (``f`` to each
    class whose constructor takes one; ``bucket_size`` is Bucketing's ``s``, ``clip_threshold``
    Clipping's ``c``)."""
    import byzfl

    def build(class_name: str) -> Any:
        cls = getattr(byzfl, class_name)
        params = inspect.signature(cls.__init__).parameters
        kwargs: dict[str, Any] = {}
        if "f" in params:
            kwargs["f"] = int(f)
        if class_name == "Bucketing":
            kwargs["s"] = int(bucket_size)
        if class_name == "Clipping":
            kwargs["c"] = float(clip_threshold)
        return cls(**kwargs)

    return [build(PRE_AGGREGATORS[name]) for name in pre_aggregators], build(AGGREGATORS[aggregator])


def apply_chain(pre: Sequence[Any], aggregator: Any, vectors: np.ndarray) -> np.ndarray:
    """The chain on an (n, d) matrix: each pre-aggregator in order, then the aggregator; byzfl's
    refusal (too few vectors for ``f``) as :class:`AggregationRefused`."""
    try:
        for step in pre:
            vectors = np.asarray(step(vectors.copy()))
        return np.asarray(aggregator(vectors))
    except ValueError as err:
        raise AggregationRefused(str(err)) from err


def takes_f(aggregator: str, pre_aggregators: Sequence[str]) -> bool:
    """Whether the aggregator or a pre-aggregator takes ``f``."""
    return aggregator in TAKES_F or any(p in TAKES_F for p in pre_aggregators)


def check_chain(defence: Any, n: int, what: str) -> None:
    """A :class:`~fedmm.errors.ConfigError` before the first round when the configured chain
    cannot take ``n`` updates (``what``: where n comes from): byzfl's own refusal on n vectors,
    a subset search too large, a Krum screen without neighbours."""
    from fedmm.errors import ConfigError

    if defence.krum_screen and n < 2 * defence.f + 3:
        raise ConfigError("strategy.defence.f", defence.f, f"at most {max(0, (n - 3) // 2)} with "
                          f"strategy.defence.krum_screen and {n} updates per aggregation ({what}): Krum needs n > 2f + 2")
    if defence.aggregator == "mean":
        return
    if defence.aggregator in SUBSET_SEARCH and subsets(n, defence.f) > MAX_SUBSETS:
        raise ConfigError("strategy.defence.aggregator", defence.aggregator, f"another aggregator with {n} updates per "
                          f"aggregation ({what}) and f={defence.f}: it searches C({n}, {defence.f}) = "
                          f"{subsets(n, defence.f):,} subsets each round (at most {MAX_SUBSETS:,})")
    pre, aggregator = byzfl_chain(defence.aggregator, defence.pre_aggregators, defence.f, defence.bucket_size,
                                  defence.clip_threshold)
    try:
        apply_chain(pre, aggregator, np.random.default_rng(0).standard_normal((n, 4)))
    except AggregationRefused as err:
        chain = " → ".join([*defence.pre_aggregators, defence.aggregator])
        raise ConfigError("strategy.defence.f", defence.f, f"a value {chain} can take with {n} updates per aggregation "
                          f"({what}); byzfl: {err}") from err


def subsets(n: int, f: int) -> int:
    """The subsets of n − f vectors among n that a subset search visits."""
    return math.comb(n, f) if 0 <= f <= n else 0


class Mean:
    """The run's mean of client models (module docstring).

    Parameters
    ----------
    aggregator : str
        ``mean`` (the method's own: weighted when weights are given) or a name of
        :data:`AGGREGATORS`.
    pre_aggregators : sequence of str
        Names of :data:`PRE_AGGREGATORS`, applied in order before the aggregator.
    f, bucket_size, clip_threshold
        The hostile nodes tolerated; Bucketing's bucket size; Clipping's norm.
    weigh : callable, optional
        The weights of a round's updates, as the run's weighting stage decides them
        (:class:`strategies.stages.Weighting`); None: :func:`weights_of` (``num-examples``).
    reference : model, optional
        The model the round's updates were sent: the robust chain acts on the differences to it.
    """

    def __init__(self, aggregator: str = "mean", pre_aggregators: Sequence[str] = (), f: int = 0, *,
                 bucket_size: int = 2, clip_threshold: float = 2.0, weigh: Weigh | None = None,
                 reference: Mapping[str, np.ndarray] | None = None) -> None:
        if aggregator != "mean" and aggregator not in AGGREGATORS:
            raise ValueError(f"aggregator {aggregator!r}; allowed: mean, {', '.join(AGGREGATORS)}")
        if aggregator == "mean" and pre_aggregators:
            raise ValueError("pre-aggregators need a robust aggregator (aggregator 'mean' is the method's own)")
        self.aggregator, self.pre_aggregators, self.f = aggregator, tuple(pre_aggregators), int(f)
        self.bucket_size, self.clip_threshold = int(bucket_size), float(clip_threshold)
        self.weigh, self.reference = weigh, reference

    @classmethod
    def of(cls, defence: Any, weigh: Weigh | None = None, reference: Mapping[str, np.ndarray] | None = None) -> Mean:
        """The mean ``strategy.defence`` configures."""
        return cls(defence.aggregator, defence.pre_aggregators, defence.f, bucket_size=defence.bucket_size,
                   clip_threshold=defence.clip_threshold, weigh=weigh, reference=reference)

    @property
    def robust(self) -> bool:
        """Whether the run replaces the mean by a robust aggregator (weights then play no part)."""
        return self.aggregator != "mean"

    def __call__(self, models: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float] | None = None, *,
                 deltas: bool = False) -> ModelDict:
        """The mean of ``models``: the robust chain when the run configures one, else weighted by
        ``weights`` (None: unweighted). ``deltas``: the vectors are differences already."""
        if self.robust:
            return self.robust_mean(models, None if deltas else self.reference)
        if weights is None:
            return mean_models(models)
        return weighted_mean_models(models, weights)

    def robust_mean(self, models: Sequence[Mapping[str, np.ndarray]],
                    reference: Mapping[str, np.ndarray] | None) -> ModelDict:
        """The configured chain over ``models`` (as differences to ``reference`` when given)."""
        first = models[0]
        floating = [k for k, v in first.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]
        dtype = np.result_type(*(np.asarray(first[k]).dtype for k in floating)) if floating else np.float64
        out: ModelDict = {}
        if floating:
            def row(model: Mapping[str, np.ndarray]) -> np.ndarray:
                flat = np.concatenate([np.ravel(np.asarray(model[k], dtype)) for k in floating])
                return flat if reference is None else flat - base

            base = None if reference is None else np.concatenate([np.ravel(np.asarray(reference[k], dtype)) for k in floating])
            pre, aggregator = byzfl_chain(self.aggregator, self.pre_aggregators, self.f, self.bucket_size, self.clip_threshold)
            result = apply_chain(pre, aggregator, np.stack([row(m) for m in models]))
            if base is not None:
                result = result + base
            start = 0
            for key in floating:
                shape = np.shape(first[key])
                size = int(np.prod(shape))
                out[key] = result[start:start + size].reshape(shape).astype(np.asarray(first[key]).dtype)
                start += size
        for key, value in first.items():
            if key not in out:  # integer entries: the coordinate-wise median
                stack = np.stack([np.asarray(m[key], np.float64) for m in models])
                out[key] = np.rint(np.median(stack, axis=0)).astype(np.asarray(value).dtype)
        return {key: out[key] for key in first}

    def weights(self, updates: list[ClientUpdate]) -> list[float]:
        """The weights of ``updates`` in a one-model mean, as the run decides them (the weighting
        stage: the selector's, else ``num-examples``; unweighted under differential privacy)."""
        return list(self.weigh(updates)) if self.weigh is not None else weights_of(updates)
