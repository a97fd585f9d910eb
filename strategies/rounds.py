"""What every round starts and ends with, written once, and the synchronous round.

Whatever drives a method (the synchronous round here, the asynchronous loop of
:mod:`strategies.asynchronous`, secure recombination's phases), a round starts with :func:`begin`
and ends with :func:`end`:

1. the defence stage (:func:`strategies.defence.defend`) on the accepted updates, each against
   the model it was sent (``update.sent``): screens, norm bounds, refill;
2. the selector sees the kept updates (clustered sampling);
3. the method aggregates the kept updates and the refilled stand-ins through the run's mean
   (:class:`strategies.aggregators.Mean`), which it is handed: it cannot skip a robust mean;
4. an aggregate with NaN or Inf replaces nothing (the previous models stay, the round counts no
   accepted reply);
5. the nodes whose updates were kept are recorded (their objectives keep the state they made),
   and the server's arrays are frozen: never written in place from here on, so a
   ``state_dict()`` taken after a round stays that round's state.

No method can skip a stage: a method is only asked for its :meth:`~strategies.method.Method.aggregate`.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import ERROR, INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from fedmm import protocol
from fedmm.protocol import ClientUpdate
from strategies.aggregation import non_finite_key
from strategies.aggregators import AggregationRefused, Mean
from strategies.defence import ONE_MODEL, check_model, defend
from strategies.evaluation import client_metrics
from strategies.ledger import ReplyCheck
from strategies.loop_log import connected, log_train_round

#: A method (:class:`strategies.method.Method`): this module runs any, and imports none.
Method = Any


def begin(strategy: Method, arrays: ArrayRecord) -> None:
    """What every round starts with: the models from ``arrays`` the first time (the method's
    ``initialize``; a setting that cannot act on the model is refused then, before any node is
    asked), the spec replies must match, an empty ``round_log``."""
    if strategy.models is None:
        strategy.initialize(protocol.record_to_model(arrays))
        check_model(strategy.settings.defence, strategy.models[0])
    assert strategy.models is not None
    if strategy.replies.spec is None:
        strategy.replies.spec = protocol.array_spec(strategy.models[0])
    strategy.round_log = {}


def end(strategy: Method, server_round: int, updates: list[ClientUpdate], rejected: list[str],
        members: list[int] | None = None) -> tuple[ArrayRecord | None, MetricRecord]:
    """The end of a round (module docstring): ``updates`` are the accepted ones, each with its
    ``sent`` model; the stage's rejections go into ``rejected``. ``members``: the models taking
    part, for a method with a model per node whose round is a part of its models (asynchronous:
    the B that came back). Returns (the global model's arrays, None when unchanged; the train metrics)."""
    stand_ins: list[ClientUpdate] = []
    if updates and strategy.privacy is not None:  # clipped against the sent models (and, per model, noised)
        updates = strategy.privacy.stage(updates, rejected, [strategy.where(u.node_id, u.slot) for u in updates])
        strategy.round_log.update(strategy.privacy.last)
    if updates:
        names = [strategy.where(u.node_id, u.slot) for u in updates]
        verdicts: list[Any] = []
        judged = list(updates)
        updates, stand_ins = defend(strategy.settings.defence, updates, [u.sent for u in updates], names, rejected,
                                    strategy.round_log, verdicts)
        strategy.observers.on_stage(server_round, judged, verdicts[0])
        strategy.selector.observe(server_round, updates, [u.sent for u in updates])
    strategy.last_round.replies, strategy.last_round.rejections = len(updates), rejected
    strategy.round_log.update(client_metrics(updates, strategy.weighted_by_key))
    metrics = strategy.train_metrics(updates)
    previous = (list(strategy.models or []), strategy.global_model)
    moments = strategy.optimizer.state_dict() if strategy.optimizer is not None else None
    # the robust chain acts on updates: differences to the model they were sent (the multi-model
    # methods' global mean: to the previous global model)
    reference = previous[0][0] if previous[0] and strategy.holds == ONE_MODEL else previous[1]
    weigh = strategy.selector.aggregation_weights if strategy.privacy is None else (lambda ups: [1.0] * len(ups))
    mean = Mean.of(strategy.settings.defence, weigh, reference)
    taking_part = {} if members is None else {"members": members}
    strategy.observers.on_aggregate(server_round, updates + stand_ins)
    try:
        global_model = strategy.aggregate(server_round, updates + stand_ins, mean, **taking_part)
        refused = ""
    except AggregationRefused as err:  # too few updates for the aggregator's f: nothing aggregated
        global_model, refused = None, f"strategy.defence.aggregator={mean.aggregator} refused the round's " \
                                      f"{len(updates + stand_ins)} updates ({err})"
    if strategy.privacy is not None and updates and global_model is not None and strategy.privacy.releases == "mean":
        global_model = strategy.privacy.release(global_model, len(updates))  # the mean of the round's updates, noised
        strategy.models = [global_model]
    if strategy.optimizer is not None and global_model is not None:  # the server's step: the optimizer's
        global_model = strategy.optimizer.step(server_round, previous[0][0], global_model)
        strategy.models = [global_model]
    bad = refused or non_finite_key(global_model) or next((k for m in strategy.models or [] if (k := non_finite_key(m))), None)
    if bad:
        strategy.models, strategy.global_model = previous
        if moments is not None:
            strategy.optimizer.load_state_dict(moments)
        if refused:
            log(ERROR, "round %d: %s; the models before it are kept", server_round, refused)
        else:
            log(ERROR, "round %d: the aggregate has NaN/Inf in %s; the models before it are kept", server_round, bad)
        strategy.last_round.replies = 0
        if "replies" in metrics:
            metrics["replies"] = 0.0
        return None, metrics
    if global_model is not None:
        strategy.global_model = global_model
    if strategy.privacy is not None and updates:  # the round's release, accounted
        strategy.round_log["epsilon"] = strategy.privacy.account()
    for update in updates:  # their objectives keep the state they made (objectives.base.LocalUpdate.keep)
        strategy.replies.accepted_rounds[update.node_id] = server_round - update.staleness
    for model in [*(strategy.models or []), strategy.global_model or {}]:
        for value in model.values():
            value.setflags(write=False)
    return (None if global_model is None else protocol.model_to_record(global_model)), metrics


class SyncRound:
    """The synchronous round: the selected nodes each get their slot's model in a message of
    their own, every reply is checked as it arrives (the ledger), then the round ends (:func:`end`).

    Parameters
    ----------
    strategy : Method
        The method it drives (its hooks: ``model_for_slot``, ``prepare_round``,
        ``extra_records``, ``reply_extras``, ``aggregate``).
    """

    #: No round barrier (refused with secure recombination): no. The roster query asks for sizes: no.
    asynchronous = False
    needs_sizes = False

    def __init__(self, strategy: Method) -> None:
        self.strategy = strategy

    def configure(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        """One train message per selected node: the model of its slot, its own config copy."""
        s = self.strategy
        begin(s, arrays)
        with s.observers.phase(server_round, "select"):
            node_ids = s.selector.select(grid, server_round, s.clients_per_round)
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_ids), connected(s.selector, grid))
        s.round_log.update(s.selector.round_info)
        with s.observers.phase(server_round, "configure"):
            s.prepare_round(server_round, s.participants(node_ids))
            encoded: dict[int, ArrayRecord] = {}  # each server model encoded once per round
            messages = []
            for slot, node_id in enumerate(node_ids):
                index = s.model_for_slot(slot)
                if index not in encoded:
                    encoded[index] = protocol.model_to_record(s.models[index])
                node_config = {**dict(config), protocol.SERVER_ROUND: server_round, protocol.MODEL_INDEX: index,
                               protocol.ACCEPTED_ROUND: s.replies.accepted_rounds.get(node_id, 0),
                               **(s.privacy.train_config() if s.privacy is not None else {})}
                messages.append(protocol.server_message(
                    protocol.TRAIN, node_id, node_config, encoded[index], s.extra_records(server_round, slot),
                    arrays_key=s.arrayrecord_key, config_key=s.configrecord_key))
        # Message ids are assigned when the grid pushes the messages: keep their metadata only
        # (the encoded models are the grid's to hold until the replies are in).
        s.replies.expect_replies([msg.metadata for msg in messages], ReplyCheck.of(s, server_round))
        return messages

    def aggregate(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord]:
        """Flower's ``aggregate_train``: check every reply, then end the round."""
        for reply in replies:
            self.strategy.replies.accept_reply(reply)
        return self.finish(server_round)

    def finish(self, server_round: int) -> tuple[ArrayRecord | None, MetricRecord]:
        """After the round's replies went through the ledger: the missing ones are rejections
        (and, on the virtual clock, the late ones), then the round ends (:func:`end`)."""
        s = self.strategy
        with s.observers.phase(server_round, "aggregate"):
            updates, rejected, sent = s.replies.close_round(s.clock, s.selector)
            s.round_log["virtual_time"] = s.clock.now
            for update in updates:
                update.sent = s.models[s.model_for_slot(update.slot)]
            result = end(s, server_round, updates, rejected)
        log_train_round(server_round, s.last_round.replies, sent, rejected)
        return result

    def run(self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord,
            timeout: float) -> tuple[ArrayRecord | None, MetricRecord]:
        """One round: the messages, the replies checked as they arrive, the round's end."""
        messages = self.configure(server_round, arrays, config, grid)
        with self.strategy.observers.phase(server_round, "exchange"):
            self.strategy.send(grid, messages, timeout, on_reply=self.strategy.replies.accept_reply)
        return self.finish(server_round)

    def start(self, num_rounds: int) -> None:
        """Called when the strategy starts (nothing to prepare)."""

    def describe(self) -> str:
        return ""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        """Nothing of its own to restore."""
