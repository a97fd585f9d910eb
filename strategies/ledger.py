"""The train replies of a run: how one reply is checked, and the bookkeeping of a round's replies.

:class:`ReplyCheck` is the one check every train reply goes through, in the synchronous rounds
(:class:`ReplyLedger`, which the secure recombination's upload phase uses too) and in the
asynchronous loop (:class:`strategies.asynchronous.AsyncRound`): decode and validate
it (:func:`fedmm.protocol.decode_train_reply`), then bound its ``num-examples`` (the node's roster
size, else ``strategy.max_num_examples``).

:class:`ReplyLedger` keeps, for the round in progress, which message fills which slot, the
updates accepted, the slots heard from and every rejection with its reason; and, for the run,
the array spec a reply must match and the round each node's reply was last accepted in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flwr.app import Message

from fedmm import protocol
from fedmm.protocol import ClientUpdate
from strategies.contract import PER_NODE

if TYPE_CHECKING:
    from strategies.heterogeneity import VirtualClock
    from strategies.selection import ClientSelector


class RunFailed(RuntimeError):
    """The run cannot go on (e.g. no client reply was accepted for ``max_failed_rounds`` rounds)."""


@dataclass
class RoundOutcome:
    """How the last round went: replies accepted, why the others were rejected, and why the
    round's end failed ("" when it did not: the aggregator refused its updates, NaN/Inf)."""

    replies: int = 0
    rejections: list[str] = field(default_factory=list)
    failure: str = ""

    def why_failed(self, rounds: int, last: int, limit: int) -> str:
        """The reason of a run that ``rounds`` failed rounds in a row, up to ``last``, ended."""
        span = f"{rounds} consecutive rounds ({last - rounds + 1}..{last}; max_failed_rounds={limit})"
        if self.failure:  # replies came back, and the round's end refused them (the aggregator, NaN/Inf)
            return f"{self.failure}: nothing was aggregated in {span}, the last one's reason given"
        why = self.rejections[0] if self.rejections else "no node was selected"
        return f"no client reply was accepted in {span}; e.g. {why}"


@dataclass(frozen=True)
class ReplyCheck:
    """What the train replies of one round are checked against.

    ``bound(node)`` is the largest ``num-examples`` a reply of ``node`` may report and where that
    bound comes from (``(None, "")``: no bound); ``extras``, ``metrics``: the records and metrics
    every reply must carry, each metric a finite number > 0 (the method's ``needs``).
    """

    spec: protocol.ArraySpec
    extras: dict[str, protocol.ArraySpec]
    copy: bool
    arrays_key: str
    weight_key: str
    bound: Callable[[int], tuple[int | None, str]]
    metrics: tuple[str, ...] = ()
    #: Said after a NaN/Inf rejection (under differential privacy: the noise is the likely cause).
    non_finite_hint: str = ""

    @classmethod
    def of(cls, context: Any, server_round: int) -> ReplyCheck:
        """The check of the train replies of ``server_round`` of a run (its
        :class:`~strategies.context.RunContext`, whose method's models exist). A method with a
        model per node gets writable arrays (FedCross fuses into them), any other read-only views
        of the replies' bytes."""
        assert context.replies.spec is not None
        method = context.method
        selector, cap = context.selector, method.settings.max_num_examples

        def bound(node: int) -> tuple[int | None, str]:
            reported = selector.num_examples(node)
            if reported is not None:
                return int(reported), "the size the node reported in the roster"
            return (int(cap), "strategy.max_num_examples") if cap is not None else (None, "")

        needs = method.needs(server_round)
        hint = "" if context.privacy is None else context.privacy.non_finite_hint()
        return cls(context.replies.spec, dict(needs.arrays), method.holds == PER_NODE, context.conventions.arrayrecord_key,
                   context.conventions.weighted_by_key, bound, tuple(needs.metrics), hint)

    def check(self, reply: Message, slot: int, node: int, taken: bool = False) -> tuple[ClientUpdate | None, str]:
        """(update, "") for a usable reply of ``node`` filling ``slot``, else (None, why). Its
        serialized arrays are released as they are decoded. ``taken``: the slot already has an
        accepted update (a reply that decodes is then a duplicate)."""
        update, reason = protocol.decode_train_reply(
            reply, slot, self.spec, self.extras, consume=True, copy=self.copy,
            arrays_key=self.arrays_key, weight_key=self.weight_key,
        )
        if update is None:
            return None, reason + (self.non_finite_hint if "NaN or Inf" in reason else "")
        if taken:
            return None, "duplicate reply"
        bound, source = self.bound(node)
        if bound is not None and update.num_examples > bound:
            return None, f"{protocol.printable(self.weight_key)}={update.num_examples:.0f} exceeds {source} ({bound})"
        for name in self.metrics:
            value = update.metrics.get(name)
            if value is None or not math.isfinite(value) or value <= 0:
                return None, f"the reply's metric {protocol.printable(name)} is {value!r}, not a finite number > 0 (the method needs it)"
        return update, ""


class ReplyLedger:
    """The train replies of a run: the current round's slots, accepted updates and rejections.

    A round's train phase names the messages whose replies count (:meth:`expect_replies`),
    hands each reply to :meth:`accept_reply` as it arrives, may mark a slot as failed
    (:meth:`fail_slot`), and ends with :meth:`close_round`.

    Parameters
    ----------
    where : callable
        ``(node id, slot) -> str``: how log lines and rejections name a node.
    """

    def __init__(self, where: Callable[[int, int], str]) -> None:
        self.where = where
        #: Key -> (shape, dtype) that every reply's model must match (set with the first models).
        self.spec: protocol.ArraySpec | None = None
        #: node id -> the last round whose train reply of that node was accepted (sent to the
        #: node with its next train message: its objective keeps state made in a rejected round
        #: out, :meth:`objectives.base.LocalUpdate.keep`).
        self.accepted_rounds: dict[int, int] = {}
        # Metadata of the round's train messages (the grid fills in their ids when it pushes
        # them); the messages themselves are not kept once pushed.
        self._pending: list[Any] = []
        self._slot_of: dict[str, int] | None = None
        self._check: ReplyCheck | None = None
        self._updates: list[ClientUpdate] = []
        self._seen: set[int] = set()
        self._rejected: list[str] = []

    def expect_replies(self, pending: list[Any], check: ReplyCheck) -> None:
        """The slots of this round's train replies: ``pending[slot]`` is the metadata of the
        message whose reply fills that slot (anything with ``message_id`` and ``dst_node_id``),
        each reply checked with ``check``. Forgets every reply accepted so far in this round."""
        self._pending, self._check, self._slot_of = list(pending), check, None
        self._updates, self._seen, self._rejected = [], set(), []

    def accepted_updates(self) -> list[ClientUpdate]:
        """The updates accepted so far in this round (in arrival order)."""
        return list(self._updates)

    def rejection(self, node_id: int) -> str | None:
        """Why a reply of ``node_id`` was rejected this round, or None."""
        prefixes = (f"node {node_id}:", f"node {node_id} (")
        return next((r.split(": ", 1)[-1] for r in self._rejected if r.startswith(prefixes)), None)

    def fail_slot(self, slot: int, reason: str) -> None:
        """Count ``slot`` as failed this round with ``reason`` (its model stays where it was)."""
        self._seen.add(slot)
        self._rejected.append(f"{self.where(self._pending[slot].dst_node_id, slot)}: {reason}")

    def accept_reply(self, reply: Message) -> None:
        """Check one train reply of the current round as soon as it arrives (:class:`ReplyCheck`)."""
        assert self._check is not None
        if self._slot_of is None:
            self._slot_of = {metadata.message_id: slot for slot, metadata in enumerate(self._pending)}
        slot = self._slot_of.get(reply.metadata.reply_to_message_id)
        if slot is None:
            self._rejected.append(f"node {reply.metadata.src_node_id}: reply to an unknown message")
            return
        # the node the message was sent to: an error reply that Flower builds for a lost node
        # (e.g. "Reply message objects are unavailable") carries the ServerApp's own node id
        node = self._pending[slot].dst_node_id
        self._seen.add(slot)
        update, reason = self._check.check(reply, slot, node, taken=any(u.slot == slot for u in self._updates))
        if update is None:
            self._rejected.append(f"{self.where(node, slot)}: {reason}")
        else:
            self._updates.append(update)

    def close_round(self, clock: VirtualClock, selector: ClientSelector) -> tuple[list[ClientUpdate], list[str], int]:
        """End the round's bookkeeping: (accepted updates in slot order, rejections, messages
        sent). A slot not heard from timed out; on the virtual clock
        (:meth:`~strategies.heterogeneity.VirtualClock.close_round`) replies of stragglers past
        ``heterogeneity.deadline`` and of clients that were or went offline are rejected."""
        updates, seen, rejected, pending = self._updates, self._seen, self._rejected, self._pending
        self.expect_replies([], self._check)  # type: ignore[arg-type]
        for slot, metadata in enumerate(pending):
            if slot not in seen:
                rejected.append(f"{self.where(metadata.dst_node_id, slot)}: no reply within the round timeout")
        nodes = [metadata.dst_node_id for metadata in pending]
        kept, late = clock.close_round(nodes, updates, selector)
        rejected.extend(f"{self.where(nodes[slot], slot)}: {reason}" for slot, reason in late)
        kept.sort(key=lambda u: u.slot)
        return kept, rejected, len(pending)

    def record_accepted(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """The nodes of ``updates`` had a reply accepted in ``server_round``."""
        for update in updates:
            self.accepted_rounds[update.node_id] = server_round
