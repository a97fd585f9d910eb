"""The ClientApp's side of FedMR's secure recombination: one handler per message action.

``train.secure_keys`` (the dispatched model; train it first in ``after`` mode) → the node's
ephemeral public key; ``train.secure_send`` (settle the last repetition, train first at the start
of the ``after`` exchange in ``both`` mode, then stage 1) → sealed layers to relay;
``train.secure_return`` (stages 2 and 3) → sealed layers to return; ``train.secure_upload``
(settle, train in ``before`` mode) → the model. "Settle" is stage 4 (assemble the returned
layers) or, when the server says a participant failed, the roll back to the model the exchange
started from. The node's protocol state (:class:`fedmm.secure.NodeExchange`) lives in
``Context.state`` between messages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord

from fedmm import protocol, secure_protocol
from fedmm.layers import layer_units
from fedmm.protocol import ModelDict
from fedmm.secure import LayerCodec, NodeExchange, Sealed, SecureError, step_number, upload_step

#: ``Context.state`` records of the node's protocol state: metadata + private key, and arrays.
STATE_META = "secure-node"
STATE_ARRAYS = "secure-arrays"

#: (run config, context, round, model) -> (trained model, training metrics)
#: Local training inside the exchange: (the run config's JSON text, context, round, model) -> (model, metrics).
TrainFn = Callable[[str, Context, int, ModelDict], tuple[ModelDict, dict[str, float]]]


def save(context: Context, node: NodeExchange) -> None:
    state = node.to_state()
    context.state[STATE_META] = ConfigRecord({"meta": state["meta"], "private": state["private"]})
    context.state[STATE_ARRAYS] = protocol.model_to_record(state["arrays"])


def load(context: Context, server_round: int, run_id: int) -> NodeExchange:
    """The node's protocol state of this round; SecureError when it has none (e.g. the SuperNode
    restarted, or the key setup of the round never reached it)."""
    if STATE_META not in context.state or STATE_ARRAYS not in context.state:
        raise SecureError(f"node {context.node_id}: no secure-recombination state (was the key setup of round {server_round} lost?)")
    record = context.state[STATE_META]
    node = NodeExchange.from_state(str(record["meta"]), bytes(record["private"]), protocol.record_to_model(context.state[STATE_ARRAYS]))
    if node.server_round != server_round or node.run_id != run_id:
        raise SecureError(
            f"node {context.node_id}: the secure-recombination state is of round {node.server_round}, not of round {server_round}"
        )
    return node


def codec_for(settings: Mapping[str, Any], model: ModelDict) -> LayerCodec:
    spec = {key: (value.shape, value.dtype) for key, value in model.items()}
    return LayerCodec(spec, layer_units(list(model), str(settings[secure_protocol.SECURE_GRANULARITY])), bool(settings[secure_protocol.SECURE_PAD]))


def incoming(msg: Message) -> list[Sealed]:
    """The ciphertexts of ``secure-in`` with their senders and sequence numbers."""
    settings = msg.content[secure_protocol.SECURE]
    if secure_protocol.SECURE_IN not in msg.content:
        return []
    record = msg.content[secure_protocol.SECURE_IN]
    sources = [str(src) for src in settings.get(secure_protocol.SECURE_IN_SRC, [])]
    seqs = [int(seq) for seq in settings.get(secure_protocol.SECURE_IN_SEQ, [])]
    names = list(record.keys())
    if not len(names) == len(sources) == len(seqs):
        raise SecureError(f"{len(names)} ciphertexts for {len(sources)} senders and {len(seqs)} sequence numbers")
    return [(src, seq, protocol.decode_array(record[name]).tobytes()) for name, src, seq in zip(names, sources, seqs)]


def outgoing(out: list[Sealed]) -> dict[str, Any]:
    """Reply records carrying sealed layers for the server to relay."""
    arrays = ArrayRecord({str(i): protocol.encode_array(np.frombuffer(ct, dtype=np.uint8)) for i, (_, _, ct) in enumerate(out)})
    config = ConfigRecord({secure_protocol.SECURE_OUT_DST: [dst for dst, _, _ in out], secure_protocol.SECURE_OUT_SEQ: [seq for _, seq, _ in out]})
    return {secure_protocol.SECURE_OUT: arrays, secure_protocol.SECURE: config}


def _train(node: NodeExchange, config: str, context: Context, server_round: int, train_fn: TrainFn) -> None:
    node.model, metrics = train_fn(config, context, server_round, node.model)
    node.metrics = {key: float(value) for key, value in metrics.items()}


def _settle(node: NodeExchange, msg: Message, settings: Mapping[str, Any], codec: LayerCodec) -> None:
    if bool(settings.get(secure_protocol.SECURE_ROLLBACK, False)):
        node.rollback()
    elif node.phase == "returned":
        node.assemble(incoming(msg), codec)
    elif node.phase != "idle":
        raise SecureError(f"node {node.node}: the repetition left open was neither assembled nor rolled back")


def handle(msg: Message, context: Context, train_fn: TrainFn) -> Message:
    """Handle one ``train.secure_*`` message (see the module docstring)."""
    action = msg.metadata.message_type.partition(".")[2]
    config = protocol.run_config_text(msg)
    server_round = protocol.server_round(msg)
    settings = msg.content[secure_protocol.SECURE]
    run_id = int(msg.metadata.run_id)
    if action == secure_protocol.SECURE_KEYS:
        model = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)
        node = NodeExchange.start(run_id, server_round, str(context.node_id), model)
        if bool(settings.get(secure_protocol.SECURE_TRAIN, False)):
            _train(node, config, context, server_round, train_fn)
        save(context, node)
        return protocol.reply_message(msg, {secure_protocol.SECURE: ConfigRecord({secure_protocol.SECURE_PUBLIC_KEY: node.public})})
    node = load(context, server_round, run_id)
    codec = codec_for(settings, node.model)
    exchange = str(settings[secure_protocol.SECURE_EXCHANGE])
    attempt = int(settings[secure_protocol.SECURE_ATTEMPT])
    if action == secure_protocol.SECURE_SEND:
        repetition = int(settings[secure_protocol.SECURE_REP])
        node.advance(step_number(exchange, attempt, repetition, 1), f"stage 1 of repetition {repetition}")
        _settle(node, msg, settings, codec)
        if bool(settings.get(secure_protocol.SECURE_TRAIN, False)):
            _train(node, config, context, server_round, train_fn)
        if repetition == 1:
            peers = dict(zip(map(str, settings[secure_protocol.SECURE_PEERS]), map(bytes, settings[secure_protocol.SECURE_PUBLIC_KEYS])))
            node.begin(exchange, attempt, peers)
        elif (exchange, attempt) != (node.exchange, node.attempt):
            raise SecureError(f"node {node.node}: repetition {repetition} of an attempt that did not start here")
        out = node.send(repetition, int(settings[secure_protocol.SECURE_MIN_LAYERS]), int(settings[secure_protocol.SECURE_MAX_LAYERS]), codec)
        save(context, node)
        return protocol.reply_message(msg, outgoing(out))
    if action == secure_protocol.SECURE_RETURN:
        repetition = int(settings[secure_protocol.SECURE_REP])
        node.advance(step_number(exchange, attempt, repetition, 2), f"stage 2 of repetition {repetition}")
        if (exchange, attempt, repetition) != (node.exchange, node.attempt, node.repetition):
            raise SecureError(f"node {node.node}: stage 2 of repetition {repetition}, but stage 1 was of repetition {node.repetition}")
        out = node.receive_and_return(incoming(msg), codec)
        save(context, node)
        return protocol.reply_message(msg, outgoing(out))
    if action == secure_protocol.SECURE_UPLOAD:
        node.advance(upload_step(exchange, attempt), "the upload")
        _settle(node, msg, settings, codec)
        if bool(settings.get(secure_protocol.SECURE_TRAIN, False)):
            _train(node, config, context, server_round, train_fn)
        save(context, node)  # the snapshot stays: a failed upload elsewhere rolls this one back
        # not the padding it sealed: a per-node count of padding would tell the server the real
        # sizes, hence the layers, that the padding hides
        metrics = {**node.metrics, secure_protocol.SECURE_BYTES_SEALED: float(node.bytes_sealed)}
        return protocol.reply_message(msg, {protocol.ARRAYS: protocol.model_to_record(node.model), protocol.METRICS: MetricRecord(metrics)})
    raise SecureError(f"unknown secure-recombination action {action!r}")
