"""What every round starts and ends with, written once, and the synchronous round.

Whatever drives a method (the synchronous round here, the asynchronous loop of
:mod:`strategies.asynchronous`, secure recombination's phases), a round starts with :func:`begin`
and ends with :func:`end`, a loop over the run's stages (:mod:`strategies.stages`: the DP clip,
the defence screens, the trust stage, the selector's observation, the weighting, the method's aggregate, the DP
release, the server optimizer, the NaN guard, the accounting, the commit). No method can skip a
stage: a method is only asked for its :meth:`~strategies.method.Method.aggregate`.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import ERROR, INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

import numpy as np

from fedmm import protocol
from fedmm.protocol import ClientUpdate
from strategies.contract import model_index
from strategies.ledger import ReplyCheck
from strategies.loop_log import connected, log_train_round
from strategies.stages import RoundEnd, check_first_model

#: The run context (:class:`strategies.context.RunContext`): this module runs any method, and imports none.
Context = Any


def begin(context: Context, arrays: ArrayRecord) -> None:
    """What every round starts with: the models from ``arrays`` the first time (the method's
    ``initialize``; a setting that cannot act on the model is refused then, before any node is
    asked), the spec replies must match, an empty ``round_log``."""
    method = context.method
    if method.models is None:
        initial = protocol.record_to_model(arrays)
        check_first_model(method.settings.defence, initial)
        method.initialize(initial)
        if context.privacy is not None:  # what the noise is against C, said before any node is asked
            context.privacy.tell(sum(int(np.size(v)) for v in initial.values() if np.issubdtype(np.asarray(v).dtype, np.floating)))
    assert method.models is not None
    if context.replies.spec is None:
        context.replies.spec = protocol.array_spec(method.models[0])
    method.round_log = {}


def end(context: Context, server_round: int, updates: list[ClientUpdate], rejected: list[str],
        members: list[int] | None = None) -> tuple[ArrayRecord | None, MetricRecord]:
    """The end of a round: the run's stages in order (:mod:`strategies.stages`) on the accepted
    ``updates`` (each with its ``sent`` model; ``members``: the models taking part, for a method
    with a model per node whose round is a part of them); when a stage fails the round, every
    stage goes back to where the round found it. Returns (the global model's arrays, None when
    unchanged; the train metrics)."""
    method = context.method
    state = RoundEnd(server_round, list(updates), rejected, members, previous=(list(method.models or []), method.global_model))
    saved = [stage.snapshot() for stage in context.stages]
    for stage in context.stages:
        stage(state)
        if state.failure:
            for undone, kept in zip(context.stages, saved):
                undone.restore(kept)
            log(ERROR, "round %d: %s; the models before it are kept", server_round, state.failure)
            context.last_round.replies, context.last_round.failure = 0, state.failure
            if "replies" in state.metrics:
                state.metrics["replies"] = 0.0
            return None, state.metrics
    return (None if state.global_model is None else protocol.model_to_record(state.global_model)), state.metrics


class SyncRound:
    """The synchronous round: the selected nodes each get their slot's model in a message of
    their own, every reply is checked as it arrives (the ledger), then the round ends (:func:`end`).

    Parameters
    ----------
    context : RunContext
        The run it drives (its method's hooks: ``prepare_round``, ``extra_records``, ``needs``,
        ``aggregate``).
    """

    def __init__(self, context: Context) -> None:
        self.context = context

    def configure(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        """One train message per selected node: the model of its slot, its own config copy."""
        c, method = self.context, self.context.method
        begin(c, arrays)
        with c.observers.phase(server_round, "select"):
            c.selector.prepare(server_round, arrays)
            node_ids = c.selector.select(grid, server_round, method.clients_per_round)
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_ids), connected(c.selector, grid))
        method.round_log.update(c.selector.round_info)
        conventions = c.conventions
        with c.observers.phase(server_round, "configure"):
            method.prepare_round(server_round, c.participants(node_ids))
            encoded: dict[int, ArrayRecord] = {}  # each server model encoded once per round
            messages = []
            extra_config = c.train_config(server_round)
            for slot, node_id in enumerate(node_ids):
                index = model_index(method, slot)
                if index not in encoded:
                    encoded[index] = protocol.model_to_record(method.models[index])
                node_config = {**dict(config), protocol.SERVER_ROUND: server_round, protocol.MODEL_INDEX: index,
                               protocol.ACCEPTED_ROUND: c.replies.accepted_rounds.get(node_id, 0), **extra_config}
                messages.append(protocol.server_message(
                    protocol.TRAIN, node_id, node_config, encoded[index], method.extra_records(server_round, slot),
                    arrays_key=conventions.arrayrecord_key, config_key=conventions.configrecord_key))
        # Message ids are assigned when the grid pushes the messages: keep their metadata only
        # (the encoded models are the grid's to hold until the replies are in).
        c.replies.expect_replies([msg.metadata for msg in messages], ReplyCheck.of(c, server_round))
        return messages

    def aggregate(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord]:
        """Flower's ``aggregate_train``: check every reply, then end the round."""
        for reply in replies:
            self.context.replies.accept_reply(reply)
        return self.finish(server_round)

    def finish(self, server_round: int) -> tuple[ArrayRecord | None, MetricRecord]:
        """After the round's replies went through the ledger: the missing ones are rejections
        (and, on the virtual clock, the late ones), then the round ends (:func:`end`)."""
        c, method = self.context, self.context.method
        with c.observers.phase(server_round, "aggregate"):
            updates, rejected, sent = c.replies.close_round(c.clock, c.selector)
            method.round_log["virtual_time"] = c.clock.now
            for update in updates:
                update.sent = method.models[model_index(method, update.slot)]
            result = end(c, server_round, updates, rejected)
        log_train_round(server_round, c.last_round.replies, sent, rejected, c.last_round.failure)
        return result

    def run(self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord,
            timeout: float) -> tuple[ArrayRecord | None, MetricRecord]:
        """One round: the messages, the replies checked as they arrive, the round's end."""
        messages = self.configure(server_round, arrays, config, grid)
        with self.context.observers.phase(server_round, "exchange"):
            self.context.send(grid, messages, timeout, on_reply=self.context.replies.accept_reply)
        return self.finish(server_round)

    def start(self, num_rounds: int) -> None:
        """Called when the strategy starts (nothing to prepare)."""

    def describe(self) -> str:
        return ""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        """Nothing of its own to restore."""
