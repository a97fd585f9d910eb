"""FedMR's secure recombination, the server's side: the message phases of one round.

The server only relays. Per round (``mode`` decides where local training sits):

=============  ==========================================================================
``keys``       ``train.secure_keys`` with the dispatched model (``after``: train it first)
               → each node's ephemeral X25519 public key
repetition r   ``train.secure_send`` (settle repetition r−1, stage 1) → sealed layers, which
               the server routes to their receivers; ``train.secure_return`` (stages 2, 3)
               → sealed returns, routed back
``upload``     ``train.secure_upload`` (settle the last repetition; ``before``: train) → model
=============  ==========================================================================

That is 2·r_s + 2 round trips per exchange (``both`` runs two exchanges, training at the start
of the second). The server checks what it relays (receivers are participants, every layer sent
gets exactly one return, sizes are layer sizes) but never sees a plaintext layer.

**All or nothing.** A participant that fails, times out or sends a malformed reply in any
phase of an exchange (its upload included, for the exchange after training) is dropped, and
every other participant rolls back to the model the exchange started from (each keeps that
snapshot until the round ends), then the exchange is retried without it, up to
``max_attempts`` times; after that the round goes on without the exchange (``secure_exchanged``
0 in ``metrics.jsonl``). No layer is ever duplicated or lost: a dropped node's slot keeps the
model it was dispatched, as for any failed node. (A node that fails after a completed
``before`` exchange held dispatched layers of other slots; those untrained layers are then
lost and its own slot's dispatched model stands in: trained layers are never affected.)

The relay metadata (who sent how many bytes to whom, per stage) of the last round is kept in
:attr:`SecureRecombination.trace`: what an honest-but-curious server sees, used by
``bench/secure_linkage.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from types import SimpleNamespace
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from fedmm import protocol, secure_protocol
from fedmm.errors import ConfigError
from fedmm.settings import Bool, Choice, Int, Nullable, Settings, setting
from fedmm.layers import layer_units
from fedmm.secure import BAD_LAYER_FROM, MAX_ATTEMPTS, MAX_REPETITIONS, MODES, RETURN, SEND, LayerCodec, exchanges_of
from strategies.contract import model_index
from strategies.ledger import ReplyCheck

#: The run of a method with K models (:class:`strategies.context.RunContext` of FedMR): the relay reads it, imports none.
Context = Any

@dataclass
class SecureSettings(Settings):
    """``strategy.secure`` of FedMR (docs/secure_recombination.md)."""

    enabled: bool = setting(False, Bool(), "exchange layers among the clients, sealed end to end", label="secure")
    mode: str = setting("both", Choice(*MODES), "before | after | both: exchange dispatched layers before training, "
                        "trained layers before upload, or both")
    repetitions: int = setting(2, Int(min=1, max=MAX_REPETITIONS), "r_s: repetitions of the 4 stages per exchange "
                               "(2·r_s + 2 round trips each)", paper="2")
    min_layers: int = setting(1, Int(min=0), "n_l: each client sends n ~ U[n_l, n_u] layers per repetition", paper="1")
    max_layers: int | None = setting(None, Nullable(Int(min=1), "null (half the model's layers, rounded up) or an integer >= 1"),
                                     "n_u; null: half the model's layers (rounded up)")
    pad: bool = setting(False, Bool(), "pad every layer to the largest one so sizes do not reveal the layer index")
    max_attempts: int = setting(2, Int(min=1, max=MAX_ATTEMPTS), "a failed participant is dropped and the exchange "
                                "retried without it, this many tries in all")

    def check_values(self, prefix: str) -> None:
        if self.max_layers is not None and self.min_layers > self.max_layers:
            raise ConfigError(f"{prefix}min_layers", self.min_layers, f"at most {prefix}max_layers={self.max_layers}")

    def label_parts(self) -> list[str]:
        if not self.enabled:
            return []
        return [f"secure {self.mode}, r_s {self.repetitions}" + (", padded" if self.pad else "")]

@dataclass(frozen=True)
class Relay:
    """One ciphertext the server relayed: what it saw of it."""

    exchange: str
    attempt: int
    repetition: int
    stage: int  # fedmm.secure.SEND or RETURN
    src: int
    dst: int
    nbytes: int


@dataclass
class _Round:
    server_round: int
    base: dict[str, Any]
    node_ids: list[int]
    codec: LayerCodec
    alive: list[int]
    keys: dict[int, bytes] = field(default_factory=dict)
    #: what each node gets with its next message: returned layers to assemble, or a rollback
    deliver: dict[int, list[tuple[int, int, Array]]] = field(default_factory=dict)
    rollback: set[int] = field(default_factory=set)
    train_pending: bool = False
    dropped: dict[int, str] = field(default_factory=dict)
    round_trips: int = 0
    attempts: int = 0
    relayed_bytes: int = 0
    exchanged: bool = True
    #: the attempt the last exchange ended with (the upload's step follows it)
    last_attempt: int = 0

    def slot(self, node: int) -> int:
        return self.node_ids.index(node)

    def drop(self, node: int, why: str) -> None:
        if node in self.alive:
            self.alive.remove(node)
            self.dropped[node] = why
            log(WARNING, "round %d: node %d dropped from secure recombination: %s", self.server_round, node, why)


class SecureRecombination:
    """The server's side of secure recombination for a multi-model strategy (FedMR).

    Parameters
    ----------
    mode : str
        ``before`` / ``after`` / ``both``: exchange dispatched layers before local training,
        trained layers before upload, or both.
    repetitions : int
        r_s: repetitions of the four stages per exchange.
    min_layers, max_layers : int
        n_l, n_u: each node sends n ~ U[n_l, n_u] layers per repetition (None: half the layers).
    pad, max_attempts : bool, int
        Pad every layer to the largest one (sizes do not reveal layer indices); tries of an
        exchange (a failure drops the node and retries without it).
    """

    def __init__(
        self, mode: str = "both", repetitions: int = 2, min_layers: int = 1, max_layers: int | None = None, pad: bool = False, max_attempts: int = 2
    ) -> None:
        exchanges_of(mode)
        if not 1 <= repetitions <= MAX_REPETITIONS:
            raise ValueError(f"repetitions={repetitions}; allowed: 1..{MAX_REPETITIONS}")
        if min_layers < 0 or (max_layers is not None and (max_layers < 1 or min_layers > max_layers)):
            raise ValueError(f"min_layers={min_layers}, max_layers={max_layers}; allowed: 0 <= min_layers <= max_layers, max_layers >= 1")
        if not 1 <= max_attempts <= MAX_ATTEMPTS:
            raise ValueError(f"max_attempts={max_attempts}; allowed: 1..{MAX_ATTEMPTS}")
        self.mode, self.repetitions, self.pad, self.max_attempts = mode, repetitions, pad, max_attempts
        self.min_layers, self.max_layers = min_layers, max_layers
        #: The relay metadata of the last round (what the server saw).
        self.trace: list[Relay] = []
        #: The models dispatched in the last round, by node id.
        self.dispatched: dict[int, protocol.ModelDict] = {}

    @classmethod
    def from_settings(cls, secure: SecureSettings) -> SecureRecombination | None:
        """The relay of ``strategy.secure`` (None when it is off)."""
        if not secure.enabled:
            return None
        return cls(secure.mode, secure.repetitions, secure.min_layers, secure.max_layers, secure.pad, secure.max_attempts)

    def settings(self) -> SecureSettings:
        """This relay's settings (enabled)."""
        return SecureSettings(enabled=True, mode=self.mode, repetitions=self.repetitions, min_layers=self.min_layers,
                              max_layers=self.max_layers, pad=self.pad, max_attempts=self.max_attempts)

    def describe(self) -> str:
        return (
            f"secure recombination: mode={self.mode} repetitions={self.repetitions} layers=[{self.min_layers}, "
            f"{self.max_layers or 'half'}] pad={self.pad} max_attempts={self.max_attempts}"
        )

    def layer_bounds(self, num_layers: int) -> tuple[int, int]:
        """(n_l, n_u) for a model of ``num_layers`` layers."""
        high = min(self.max_layers or math.ceil(num_layers / 2), num_layers)
        return min(self.min_layers, high), high

    # ================================================================== the round
    def run_round(
        self, context: Context, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord, timeout: float
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        from strategies.rounds import SyncRound, begin

        s, m = context, context.method
        begin(s, arrays)
        assert m.models is not None and s.replies.spec is not None
        spec = s.replies.spec
        s.selector.prepare(server_round, arrays)
        node_ids = list(s.selector.select(grid, server_round, m.clients_per_round))
        m.round_log.update(s.selector.round_info)
        m.prepare_round(server_round, s.participants(node_ids))
        granularity = m.settings.granularity  # FedMR's (the one method with secure recombination)
        units = layer_units(list(spec), granularity)
        low, high = self.layer_bounds(len(units))
        settings = {
            secure_protocol.SECURE_MODE: self.mode,
            secure_protocol.SECURE_GRANULARITY: granularity,
            secure_protocol.SECURE_PAD: self.pad,
            secure_protocol.SECURE_MIN_LAYERS: low,
            secure_protocol.SECURE_MAX_LAYERS: high,
        }
        rnd = _Round(
            server_round, {**dict(config), protocol.SERVER_ROUND: server_round}, node_ids,
            LayerCodec(spec, units, self.pad), list(node_ids),
        )
        self.trace = []
        self.dispatched = {node: m.models[model_index(m, slot)] for slot, node in enumerate(node_ids)}
        self._settings, self._grid, self._timeout, self._context = settings, grid, timeout, s

        self._keys(rnd)
        if self.mode in ("before", "both"):
            self._exchange(rnd, "before", closes_with_upload=False)
            rnd.train_pending = True
        if self.mode in ("after", "both"):
            self._exchange(rnd, "after", closes_with_upload=True)
        else:
            self._upload(rnd, "before", rnd.last_attempt, final=True)
        m.round_log.update(
            secure_exchanged=float(rnd.exchanged),
            secure_attempts=float(rnd.attempts),
            secure_round_trips=float(rnd.round_trips),
            secure_relayed_bytes=float(rnd.relayed_bytes),
            secure_dropped=float(len(rnd.dropped)),
        )
        return SyncRound(s).finish(server_round)

    # ================================================================== phases
    def _message(self, rnd: _Round, action: str, node: int, secure: dict[str, Any], with_model: bool = False) -> Message:
        return _relay_message(rnd, model_index(self._context.method, rnd.slot(node)), action, node, self._settings, secure,
                              self.dispatched[node] if with_model else None)

    def _send(self, rnd: _Round, messages: list[Message], on_reply: Any = None) -> dict[int, Message]:
        """One round trip; failed nodes are dropped; the replies of the others by node."""
        sent = [m.metadata.dst_node_id for m in messages]
        rnd.deliver, rnd.rollback = {}, set()  # handed over with these messages
        rnd.round_trips += 1
        replies: dict[int, Message] = {}
        if on_reply is not None:
            self._context.send(self._grid, messages, self._timeout, on_reply=on_reply)
            return replies
        for reply in self._context.send(self._grid, messages, self._timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                reason = protocol.client_error(reply.error.reason)
                rnd.drop(node, f"client error: {protocol.printable(reason, 1000)}")
                # a layer it could not open or use: the relay cannot tell whether the sender sealed
                # garbage or the receiver lies, so the named sender leaves the exchange too
                accused = re.search(re.escape(BAD_LAYER_FROM) + r"(\d+)", reason)
                if accused and int(accused.group(1)) in rnd.alive and int(accused.group(1)) != node:
                    rnd.drop(int(accused.group(1)), f"node {node} could not use a layer it sealed: {protocol.printable(reason, 1000)}")
            else:
                replies[node] = reply
        for node in sent:
            if node not in replies and node in rnd.alive:
                rnd.drop(node, "no reply within the round timeout")
        return replies

    def _keys(self, rnd: _Round) -> None:
        secure = {secure_protocol.SECURE_TRAIN: self.mode == "after"}
        replies = self._send(rnd, [self._message(rnd, secure_protocol.SECURE_KEYS, node, secure, with_model=True) for node in rnd.alive])
        for node, reply in replies.items():
            try:
                rnd.keys[node] = _public_key(reply)
            except Exception as err:  # noqa: BLE001 - whatever a node sends, the round goes on
                rnd.drop(node, str(err))
        shared: dict[bytes, list[int]] = {}
        for node, key in rnd.keys.items():
            shared.setdefault(key, []).append(node)
        for key, nodes in shared.items():  # one key for two nodes: one of them may read the other's layers
            if len(nodes) > 1:
                for node in nodes:
                    del rnd.keys[node]
                    rnd.drop(node, f"the same public key as node(s) {[n for n in nodes if n != node]}")

    def _exchange(self, rnd: _Round, exchange: str, closes_with_upload: bool) -> None:
        attempt = 0
        while attempt < self.max_attempts and len(rnd.alive) >= 2:
            rnd.attempts += 1
            failed = self._repetitions(rnd, exchange, attempt)
            if not failed and closes_with_upload:
                failed = self._upload(rnd, exchange, attempt, final=False)
            if not failed:
                rnd.last_attempt = attempt
                return
            # somebody failed: everyone else goes back to where this exchange started
            rnd.deliver, rnd.rollback = {}, set(rnd.alive)
            attempt += 1
        rnd.exchanged = False
        if attempt or len(rnd.alive) < 2:
            log(WARNING, "round %d: the %s exchange did not complete (%d participants left); it is skipped this round", rnd.server_round, exchange, len(rnd.alive))
        rnd.last_attempt = attempt
        if closes_with_upload:
            self._upload(rnd, exchange, attempt, final=True)

    def _repetitions(self, rnd: _Round, exchange: str, attempt: int) -> bool:
        """Run the r_s repetitions of one attempt; True when a participant failed."""
        participants = list(rnd.alive)
        peers = {secure_protocol.SECURE_PEERS: [str(n) for n in participants], secure_protocol.SECURE_PUBLIC_KEYS: [rnd.keys[n] for n in participants]}
        for repetition in range(1, self.repetitions + 1):
            secure = {secure_protocol.SECURE_EXCHANGE: exchange, secure_protocol.SECURE_ATTEMPT: attempt, secure_protocol.SECURE_REP: repetition}
            if repetition == 1:
                secure.update(peers)
                secure[secure_protocol.SECURE_TRAIN] = rnd.train_pending
            replies = self._send(rnd, [self._message(rnd, secure_protocol.SECURE_SEND, node, secure) for node in participants])
            rnd.train_pending = False
            routed = self._route(rnd, replies, participants, exchange, attempt, repetition, SEND, expected=None)
            if routed is None:
                return True
            sent_counts = {dst: _counts(items) for dst, items in routed.items()}
            rnd.deliver = routed
            replies = self._send(rnd, [self._message(rnd, secure_protocol.SECURE_RETURN, node, secure) for node in participants])
            returned = self._route(rnd, replies, participants, exchange, attempt, repetition, RETURN, expected=sent_counts)
            if returned is None:
                return True
            rnd.deliver = returned
        return False

    def _route(
        self, rnd: _Round, replies: dict[int, Message], participants: list[int], exchange: str, attempt: int, repetition: int, stage: int,
        expected: dict[int, dict[int, int]] | None,
    ) -> dict[int, list[tuple[int, int, Array]]] | None:
        """Check the sealed layers of every participant and route them to their receivers
        (None when a participant failed or sent something malformed)."""
        sizes = {rnd.codec.wire_bytes(i) for i in range(len(rnd.codec.units))}
        routed: dict[int, list[tuple[int, int, Array]]] = {node: [] for node in participants}
        relays = []
        for node in participants:
            if node not in replies:
                continue
            try:
                dsts, seqs, arrays = _sealed_layers(replies[node], node, set(routed), sizes,
                                                    None if expected is None else expected.get(node, {}))
            except Exception as err:  # noqa: BLE001 - whatever a node sends, the round goes on
                rnd.drop(node, f"malformed secure-recombination reply: {protocol.printable(str(err))}")
                continue
            for dst, seq, array in zip(dsts, seqs, arrays):
                routed[dst].append((node, seq, array))
                relays.append(Relay(exchange, attempt, repetition, stage, node, dst, int(array.shape[0])))
        if any(node not in rnd.alive for node in participants):
            return None
        self.trace.extend(relays)
        rnd.relayed_bytes += sum(r.nbytes for r in relays)
        for items in routed.values():
            items.sort(key=lambda item: (item[0], item[1]))
        return routed

    def _upload(self, rnd: _Round, exchange: str, attempt: int, final: bool) -> bool:
        """The models, through the strategy's reply checks. Not ``final``: True when a node
        failed (the accepted models are discarded: the exchange is retried)."""
        s = self._context
        secure = {secure_protocol.SECURE_EXCHANGE: exchange, secure_protocol.SECURE_ATTEMPT: attempt, secure_protocol.SECURE_TRAIN: rnd.train_pending}
        messages = {node: self._message(rnd, secure_protocol.SECURE_UPLOAD, node, secure) for node in rnd.alive}
        rnd.train_pending = False
        placeholder = {slot: SimpleNamespace(message_id=f"secure-dropped-{slot}", dst_node_id=node) for slot, node in enumerate(rnd.node_ids)}
        pending = [messages[node].metadata if node in messages else placeholder[slot] for slot, node in enumerate(rnd.node_ids)]
        ledger = s.replies
        ledger.expect_replies(pending, ReplyCheck.of(s, rnd.server_round))
        self._send(rnd, list(messages.values()), on_reply=ledger.accept_reply)
        accepted = {u.slot for u in ledger.accepted_updates()}
        failed = [node for node in rnd.alive if rnd.slot(node) not in accepted]
        if failed and not final:
            for node in failed:
                rnd.drop(node, ledger.rejection(node) or "no reply within the round timeout")
            ledger.expect_replies(pending, ReplyCheck.of(s, rnd.server_round))
            return True
        for node, why in rnd.dropped.items():
            ledger.fail_slot(rnd.slot(node), f"dropped from secure recombination: {why}")
        if rnd.exchanged and not failed:
            log(INFO, "round %d: secure recombination: %d round trips, %d ciphertext bytes relayed", rnd.server_round, rnd.round_trips, rnd.relayed_bytes)
        return bool(failed)


def _relay_message(rnd: _Round, model_index: int, action: str, node: int, settings: dict[str, Any],
                   secure: dict[str, Any], model: protocol.ModelDict | None) -> Message:
    """A phase's message to ``node``: the round's config, the ``secure`` record (with what the node
    must settle first: a rollback, or the layers returned to it, relayed now) and, for the phase
    that dispatches, its model."""
    config = {**rnd.base, protocol.MODEL_INDEX: model_index}
    extra: dict[str, Any] = {}
    settle: dict[str, Any] = {}
    if node in rnd.rollback:
        settle[secure_protocol.SECURE_ROLLBACK] = True
    elif node in rnd.deliver:
        relayed = rnd.deliver[node]
        extra[secure_protocol.SECURE_IN] = ArrayRecord({str(i): array for i, (_, _, array) in enumerate(relayed)})
        settle[secure_protocol.SECURE_IN_SRC] = [str(src) for src, _, _ in relayed]
        settle[secure_protocol.SECURE_IN_SEQ] = [seq for _, seq, _ in relayed]
    extra[secure_protocol.SECURE] = ConfigRecord({**settings, **settle, **secure})
    arrays = protocol.model_to_record(model) if model is not None else None
    return protocol.server_message(protocol.train_action(action), node, config, arrays, extra)


def _public_key(reply: Message) -> bytes:
    """A node's ephemeral X25519 public key from its reply (a ValueError saying what is wrong)."""
    try:
        value = reply.content[secure_protocol.SECURE][secure_protocol.SECURE_PUBLIC_KEY]
        if not isinstance(value, bytes):
            raise TypeError(f"a {type(value).__name__}, not bytes")
    except Exception as err:  # noqa: BLE001 - whatever a node sends
        raise ValueError(f"no public key in the reply ({protocol.printable(str(err))})") from None
    if len(value) != 32:
        raise ValueError(f"a public key of {len(value)} bytes, not 32")
    return bytes(value)


def _sealed_layers(reply: Message, node: int, participants: set[int], sizes: set[int],
                   owed: dict[int, int] | None) -> tuple[list[int], list[int], list[Array]]:
    """The receivers, sequence numbers and ciphertexts a participant's reply routes, checked:
    another participant each, one (receiver, sequence) pair each, layer-sized uint8 bytes, and in
    a return stage as many to each sender as it received (``owed``); a ValueError otherwise."""
    secure = reply.content[secure_protocol.SECURE]
    record = reply.content[secure_protocol.SECURE_OUT]
    dsts = [int(d) for d in secure[secure_protocol.SECURE_OUT_DST]]
    seqs = [int(q) for q in secure[secure_protocol.SECURE_OUT_SEQ]]
    arrays = list(record.values())
    if not len(dsts) == len(seqs) == len(arrays):
        raise ValueError(f"{len(arrays)} ciphertexts for {len(dsts)} receivers and {len(seqs)} sequence numbers")
    if len(set(zip(dsts, seqs))) != len(dsts):
        raise ValueError("a (receiver, sequence number) pair repeats")
    for dst, array in zip(dsts, arrays):
        if dst == node or dst not in participants:
            raise ValueError(f"receiver {dst} is not another participant")
        if array.dtype != "uint8" or len(array.shape) != 1 or array.shape[0] not in sizes:
            raise ValueError(f"a ciphertext of shape {array.shape} and dtype {array.dtype} is no sealed layer")
        real = protocol.decode_array(array).size
        if real != array.shape[0]:
            raise ValueError(f"a ciphertext declared as {array.shape[0]} bytes holds {real}")
    if owed is not None and _counts([(d, 0, None) for d in dsts]) != owed:
        raise ValueError(f"returned {len(dsts)} layers for the {sum(owed.values())} it received")
    return dsts, seqs, arrays


def _counts(items: list[tuple[int, int, Any]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for peer, _, _ in items:
        counts[peer] = counts.get(peer, 0) + 1
    return counts


class SecureRound:
    """The driver of a method with secure recombination (FedMR with ``strategy.secure`` on): each
    round is the relay's phases (:meth:`SecureRecombination.run_round`), ending as every
    synchronous round does. A synchronous driver only: the asynchronous one is refused with it."""

    def __init__(self, context: Context) -> None:
        self.context = context
        #: The relay (its ``trace``: what the server saw of the last round's ciphertexts).
        self.relay = SecureRecombination.from_settings(context.method.settings.secure)

    def configure(self, *args: Any) -> list[Message]:
        raise NotImplementedError("secure recombination's rounds have several phases: call the strategy's start() "
                                  "(Flower's configure_train / aggregate_train drive one-phase rounds)")

    aggregate = configure

    def run(self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord,
            timeout: float) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One round: the relay's phases."""
        return self.relay.run_round(self.context, server_round, grid, arrays, config, timeout)

    def start(self, num_rounds: int) -> None:
        """Nothing to prepare."""

    def describe(self) -> str:
        return self.relay.describe()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        """The relay keeps nothing across rounds."""
