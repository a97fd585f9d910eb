"""The stages of every round's end: one ordered list, one interface, no method can skip one.

Whatever drives a method (the synchronous round, the asynchronous loop, secure recombination's
phases), its round ends with :func:`strategies.rounds.end`, a loop over the run's stages
(:func:`round_end_stages`, in this order):

==================  ===========================================================================
``dp_clip``         each update clipped against the model its node was sent (and, for a
                    method that releases its models, each group's mean noised for the
                    group's updates that came back): :mod:`strategies.privacy`
``defence``         screens, norm bounds, refill, each update against its sent model:
                    :mod:`strategies.defence`
``trust``           each update weighted and rescaled by the server's reference update from
                    its root set (FLTrust): :mod:`strategies.trust`
``replies``         the round's accepted replies counted, their metrics averaged
``observation``     the selector sees the kept updates (clustered sampling)
``weighting``       each update's weight in a mean, decided here only (the selector's, else
                    ``num-examples``; unweighted under differential privacy and under trust),
                    and the run's mean
                    (:class:`strategies.aggregators.Mean`: a robust aggregator when configured)
``aggregate``       the method's :meth:`~strategies.method.Method.aggregate`
``dp_release``      the mean a one-model method releases, noised for the updates that came back
``server_step``     the server optimizer's step from the method's next model
``finite``          an aggregate with NaN or Inf fails the round
``accounting``      the round's release composed into ε
``commit``          the nodes' state of the round kept, the global model set, the arrays frozen
==================  ===========================================================================

A stage is a :class:`Stage`: it acts on the round's :class:`RoundEnd`; it may have a state for
checkpoints (``key``, ``state_dict``, ``load_state_dict``); and it declares what it refuses
(:meth:`Stage.check` when the settings are validated, :meth:`Stage.refusals` for the docs'
tables). When a stage fails the round (the aggregator cannot take its updates, the aggregate is
not finite), every stage goes back to where the round found it (:meth:`Stage.snapshot`,
:meth:`Stage.restore`): the method's models and state, the selector's observation, the
optimizer's moments, the accountant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flwr.app import MetricRecord

from fedmm.protocol import ClientUpdate, ModelDict
from strategies.aggregation import non_finite_key
from strategies.aggregators import AggregationRefused, Mean, weights_of
from strategies.contract import MEAN, MODELS, ONE_MODEL, PER_NODE, SECURE, release_of, release_refusal, steps_one_model
from strategies.defence import check_model, defend, refuse, refused_settings
from strategies.evaluation import client_metrics
from strategies.trust import trusted


@dataclass
class RoundEnd:
    """What the stages of one round's end hand on (module docstring)."""

    server_round: int
    #: The accepted updates (each stage may keep fewer), each with the model it was sent.
    updates: list[ClientUpdate]
    #: Why replies were rejected (each stage adds its own).
    rejected: list[str]
    #: The models taking part in the round, for a method with a model per node (None: all K).
    members: list[int] | None = None
    #: Updates the method aggregates that are no replies (refilled slots, untrained models).
    stand_ins: list[ClientUpdate] = field(default_factory=list)
    #: The method's models and global model as the round found them.
    previous: tuple[list[ModelDict], ModelDict | None] = ([], None)
    mean: Mean | None = None
    global_model: ModelDict | None = None
    metrics: MetricRecord = field(default_factory=MetricRecord)
    #: Why the round failed ("" while it has not): every stage then goes back.
    failure: str = ""
    #: What a method that releases its models aggregates under differential privacy: one noised
    #: group mean per released group (None: ``updates`` themselves).
    released: list[ClientUpdate] | None = None


class Stage:
    """One stage of the round's end (module docstring).

    Parameters
    ----------
    context : RunContext
        The run (:class:`strategies.context.RunContext`): its method, selector, stages' parts.
    """

    #: How the round's end and the docs name it.
    name: ClassVar[str] = ""
    #: Its checkpoint entry ("" when it keeps no state of its own).
    key: ClassVar[str] = ""

    def __init__(self, context: Any) -> None:
        self.context = context

    @classmethod
    def applies(cls, context: Any) -> bool:
        """Whether the run has this stage (default: every run)."""
        return True

    @classmethod
    def check(cls, settings: Any, run: Any) -> None:
        """A :class:`~fedmm.errors.ConfigError` when the settings ask this stage for what it
        refuses for the method (``settings.strategy_class``); default: nothing."""

    @classmethod
    def refusals(cls, method: type) -> dict[str, str]:
        """The settings this stage refuses for ``method``, each with why (the docs' tables)."""
        return {}

    def __call__(self, end: RoundEnd) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Its state for checkpoints (with ``key``)."""
        return {}

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict`."""

    def snapshot(self) -> Any:
        """What :meth:`restore` needs to undo the round (default: the checkpoint state)."""
        return self.state_dict() if self.key else None

    def restore(self, saved: Any) -> None:
        """Undo the round's effects (default: reload the snapshot)."""
        if self.key:
            self.load_state_dict(saved)


# ============================================================================ the stages
class PrivacyClip(Stage):
    """Each update clipped against the model its node was sent; a multi-model release noised,
    group by group (:func:`strategies.privacy.group_releases`)."""

    name = "dp_clip"

    @classmethod
    def applies(cls, context: Any) -> bool:
        return context.privacy is not None

    @classmethod
    def check(cls, settings: Any, run: Any) -> None:
        from strategies.privacy import check_privacy

        check_privacy(settings, run)

    @classmethod
    def refusals(cls, method: type) -> dict[str, str]:
        why = release_refusal(method)
        return {"strategy.privacy.clip_norm": why} if why else {}

    def __call__(self, end: RoundEnd) -> None:
        if end.updates:
            privacy, where = self.context.privacy, self.context.where
            end.updates = privacy.stage(end.updates, end.rejected, [where(u.node_id, u.slot) for u in end.updates])
            self.context.method.round_log.update(privacy.last)
            if privacy.releases == MODELS:
                from strategies.privacy import group_releases

                end.released, withheld = group_releases(end.updates, privacy.groups, privacy.settings.min_group_size,
                                                        privacy.noise_std, privacy.rng)
                if privacy.groups < privacy.sample:
                    self.context.method.round_log["dp_groups_withheld"] = float(len(withheld))


class DefenceStage(Stage):
    """Screens, norm bounds and refill (:func:`strategies.defence.defend`)."""

    name = "defence"

    @classmethod
    def check(cls, settings: Any, run: Any) -> None:
        method = settings.strategy_class
        refuse(settings.defence, refused_settings(method.holds, settings.driver == SECURE), settings.option)

    @classmethod
    def refusals(cls, method: type) -> dict[str, str]:
        return {f"strategy.defence.{name}": why for name, why in refused_settings(method.holds).items()}

    def __call__(self, end: RoundEnd) -> None:
        if not end.updates:
            return
        c = self.context
        names = [c.where(u.node_id, u.slot) for u in end.updates]
        verdicts: list[Any] = []
        judged = list(end.updates)
        end.updates, end.stand_ins = defend(c.method.settings.defence, end.updates, [u.sent for u in end.updates], names,
                                            end.rejected, c.method.round_log, verdicts)
        c.observers.on_stage(end.server_round, judged, verdicts[0])


class Trust(Stage):
    """FLTrust's weights and rescaling against the server's reference update (:func:`strategies.trust.trusted`)."""

    name = "trust"

    @classmethod
    def applies(cls, context: Any) -> bool:
        return context.method.settings.defence.trust_root is not None

    def __call__(self, end: RoundEnd) -> None:
        if not end.updates:
            return
        c = self.context
        if c.reference is None:
            raise RuntimeError(f"strategy.defence.trust_root={c.method.settings.defence.trust_root} needs the server's "
                               "training on its root set: the fedmm runner provides it (server_app/runner.py); a "
                               "strategy in your own ServerApp sets strategy.context.reference to a function (the "
                               "model a node was sent, the round) -> the model trained from it on the root set")
        end.updates = trusted(end.updates, c.reference, end.server_round, [c.where(u.node_id, u.slot) for u in end.updates],
                              end.rejected, c.method.round_log)


class Replies(Stage):
    """The round's accepted replies counted, their metrics averaged into the round's numbers."""

    name = "replies"

    def __call__(self, end: RoundEnd) -> None:
        c = self.context
        c.last_round.replies, c.last_round.rejections, c.last_round.failure = len(end.updates), end.rejected, ""
        c.method.round_log.update(client_metrics(end.updates, c.conventions.weighted_by_key))
        end.metrics = c.train_metrics(end.updates)


class Observation(Stage):
    """The selector sees the kept updates and the models they were sent (clustered sampling)."""

    name = "observation"

    def __call__(self, end: RoundEnd) -> None:
        if end.updates:
            self.context.selector.observe(end.server_round, end.updates, [u.sent for u in end.updates])

    def snapshot(self) -> Any:
        return self.context.selector.snapshot()

    def restore(self, saved: Any) -> None:
        self.context.selector.restore(saved)


class Weighting(Stage):
    """Each update's weight in a mean, decided here only, and the run's mean (module docstring)."""

    name = "weighting"

    def weights(self, updates: list[ClientUpdate]) -> list[float]:
        """Unweighted under differential privacy (example counts would let one client weigh
        more) and under trust (the trust stage's updates carry their weights: their plain mean
        is FLTrust's); else the selector's weights where it decides them, else ``num-examples``."""
        if self.context.privacy is not None or self.context.method.settings.defence.trust_root is not None:
            return [1.0] * len(updates)
        return weights_of(updates, self.context.selector.aggregation_weights(updates))

    def __call__(self, end: RoundEnd) -> None:
        method = self.context.method
        models, global_model = end.previous
        # the robust chain acts on updates: differences to the model they were sent (the
        # multi-model methods' global mean: to the previous global model)
        reference = models[0] if models and method.holds == ONE_MODEL else global_model
        end.mean = Mean.of(method.settings.defence, self.weights, reference)


class Aggregation(Stage):
    """The method's aggregate, through the run's mean; for a method with a model per node, the
    models of the round whose node sent no usable update come along untrained (as they were sent)."""

    name = "aggregate"

    def __call__(self, end: RoundEnd) -> None:
        c, method = self.context, self.context.method
        aggregated = (end.updates if end.released is None else end.released) + end.stand_ins
        given = list(aggregated)
        if method.holds == PER_NODE:
            present = {u.slot for u in given}
            members = range(len(method.models)) if end.members is None else end.members
            given += [ClientUpdate(-1, i, method.models[i], 0.0, {}, sent=method.models[i], trained=False)
                      for i in members if i not in present]
        c.observers.on_aggregate(end.server_round, aggregated)
        try:
            end.global_model = method.aggregate(end.server_round, given, end.mean)
        except AggregationRefused as err:  # too few updates for the aggregator's f: nothing aggregated
            end.failure = (f"strategy.defence.aggregator={end.mean.aggregator} refused the round's "
                           f"{len(aggregated)} updates ({err})")

    def snapshot(self) -> Any:
        return self.context.method.state_dict()

    def restore(self, saved: Any) -> None:
        self.context.method.load_state_dict(saved)


class PrivacyRelease(Stage):
    """The mean a one-model method releases, noised for the number of updates that came back."""

    name = "dp_release"

    @classmethod
    def applies(cls, context: Any) -> bool:
        return context.privacy is not None and release_of(type(context.method)) == MEAN

    def __call__(self, end: RoundEnd) -> None:
        if end.updates and end.global_model is not None:
            end.global_model = self.context.privacy.release(end.global_model, len(end.updates))
            self.context.method.models = [end.global_model]


class ServerStep(Stage):
    """The server optimizer's step from the model the method proposes (:mod:`strategies.server_optimizer`)."""

    name = "server_step"
    key = "server_optimizer"

    @classmethod
    def applies(cls, context: Any) -> bool:
        return context.optimizer is not None

    @classmethod
    def check(cls, settings: Any, run: Any) -> None:
        from fedmm.errors import ConfigError

        why = cls.refusals(settings.strategy_class).get("server_optimizer")
        if why and run.server_optimizer.optimizer_class is not None:
            raise ConfigError("server_optimizer", run.server_optimizer.option, f"none with strategy={settings.option} "
                              f"({why})")

    @classmethod
    def refusals(cls, method: type) -> dict[str, str]:
        if steps_one_model(method):
            return {}
        return {"server_optimizer": "a server optimizer steps the one model a method trains next; this method keeps "
                                    "several models or evaluates another model than the one it trains next"}

    def __call__(self, end: RoundEnd) -> None:
        if end.global_model is not None:
            end.global_model = self.context.optimizer.step(end.server_round, end.previous[0][0], end.global_model)
            self.context.method.models = [end.global_model]

    def state_dict(self) -> dict[str, Any]:
        return self.context.optimizer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.context.optimizer.load_state_dict(state)


class Finite(Stage):
    """An aggregate with NaN or Inf fails the round (the models before it stay)."""

    name = "finite"

    def __call__(self, end: RoundEnd) -> None:
        method = self.context.method
        bad = non_finite_key(end.global_model) or next((k for m in method.models or [] if (k := non_finite_key(m))), None)
        if bad:
            end.failure = f"the aggregate has NaN/Inf in {bad}"


class Accounting(Stage):
    """The round's release composed into ε (Flower's RDP accountant)."""

    name = "accounting"
    key = "privacy"

    @classmethod
    def applies(cls, context: Any) -> bool:
        return context.privacy is not None

    def __call__(self, end: RoundEnd) -> None:
        if end.updates:
            self.context.method.round_log["epsilon"] = self.context.privacy.account()

    def state_dict(self) -> dict[str, Any]:
        return self.context.privacy.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.context.privacy.load_state_dict(state)


class Commit(Stage):
    """The nodes whose updates were kept keep the state they made (their objectives'); the global
    model is set; the server's arrays are frozen (never written in place from here on, so a
    checkpoint taken after a round stays that round's)."""

    name = "commit"

    def __call__(self, end: RoundEnd) -> None:
        method, replies = self.context.method, self.context.replies
        if end.global_model is not None:
            method.global_model = end.global_model
        for update in end.updates:  # objectives.base.LocalUpdate.keep
            replies.accepted_rounds[update.node_id] = end.server_round - update.staleness
        for model in [*(method.models or []), method.global_model or {}]:
            for value in model.values():
                value.setflags(write=False)


#: Every stage, in the order a round's end runs them.
STAGES: tuple[type[Stage], ...] = (PrivacyClip, DefenceStage, Trust, Replies, Observation, Weighting, Aggregation, PrivacyRelease,
                                   ServerStep, Finite, Accounting, Commit)


def round_end_stages(context: Any) -> list[Stage]:
    """The stages of ``context``'s run, in order (those that apply to it)."""
    return [stage(context) for stage in STAGES if stage.applies(context)]


def check_stages(settings: Any, run: Any) -> None:
    """Each stage's refusals for the run's method (when the settings are validated)."""
    for stage in STAGES:
        stage.check(settings, run)


def refusal_table(methods: dict[str, type]) -> list[tuple[str, str, str, str]]:
    """(method option, stage, setting, why) for every refusal of every stage (the docs' table)."""
    rows = []
    for option, method in methods.items():
        for stage in STAGES:
            rows += [(option, stage.name, key, why) for key, why in stage.refusals(method).items()]
    return rows


#: The check a driver runs where every round starts, for settings that act on the model itself.
check_first_model: Callable[[Any, ModelDict], None] = check_model
