"""The ClientApp: local training and evaluation of whatever model the server sends.

Every train/evaluate message carries the model (``arrays``) and a ``config`` record holding the
round, the run's resolved configuration as JSON and, for multi-model strategies, the index of the
model sent (names in :mod:`fedmm.protocol`). The client needs no config of its own, except where
its data lives:

- simulation: ``partition-id`` / ``num-partitions`` from the node config select a partition;
- deployment: ``data-path`` in the node config points to the node's own dataset folder.

The local-update plugin (``objective.name``) decides the loss, the optimizer step, the state kept
in ``Context.state`` across rounds and any extra reply records.

This module stays light (no torch, no data stack): the handlers import :mod:`client_app.work`
when a message needs a model trained or evaluated, so a roster query or a relay stage of secure
recombination costs a deployed SuperNode (a fresh ClientApp process per message) a fraction of
the start-up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from client_app import secure
from fedmm import protocol, secure_protocol

#: Node config key of a deployed SuperNode's dataset folder (see client_app.node_data).
DATA_PATH_KEY = protocol.DATA_PATH_KEY


def node_key(node_config: Mapping[str, Any], node_id: int) -> str:
    """A key that identifies this node's data across runs (used for reproducible sampling)."""
    if "partition-id" in node_config:
        return f"partition:{int(node_config['partition-id']):09d}"
    if DATA_PATH_KEY in node_config:
        return f"data:{node_config[DATA_PATH_KEY]}"
    return f"node:{node_id:020d}"


def train(msg: Message, context: Context) -> Message:
    """Train the received model on the local data with the configured local-update plugin."""
    from client_app import work

    return work.train_reply(msg, context)


def train_batch(messages: Sequence[Message], contexts: Sequence[Context]) -> list[Any] | None:
    """The in-process engine's handler of a round's train messages (``simulation.vectorize``):
    trained as one computation, each reply what :func:`train` would send (or the exception it
    would raise), or None where they train one at a time (client_app/vectorized.py)."""
    from client_app import vectorized

    return vectorized.train_messages(messages, contexts)


def secure_train(config: str, context: Context, server_round: int, arrays: protocol.ModelDict) -> tuple[protocol.ModelDict, dict[str, float]]:
    """The local training inside a secure-recombination exchange (the ``train_fn`` argument of
    :func:`client_app.secure.handle`): ``arrays`` trained with the run config ``config`` (JSON)."""
    from client_app import work
    from fedmm.config import client_run

    return work.secure_train(client_run(config), context, server_round, arrays)


def secure_keys(msg: Message, context: Context) -> Message:
    """Secure recombination: key setup (and training, when the exchange is after it)."""
    return secure.handle(msg, context, secure_train)


def secure_send(msg: Message, context: Context) -> Message:
    """Secure recombination: settle the last repetition (train first at the start of the
    exchange after training, in ``both`` mode), then stage 1 (send layers)."""
    return secure.handle(msg, context, secure_train)


def secure_return(msg: Message, context: Context) -> Message:
    """Secure recombination: stages 2 and 3 (receive layers, return random ones)."""
    return secure.handle(msg, context, secure_train)


def secure_upload(msg: Message, context: Context) -> Message:
    """Secure recombination: settle the last repetition (train in ``before`` mode), upload."""
    return secure.handle(msg, context, secure_train)


def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this node's held-out rows (federated evaluation)."""
    from client_app import work

    return work.evaluate_reply(msg, context)


def query(msg: Message, context: Context) -> Message:
    """Report this node's stable key so the server samples reproducibly, and, when asked
    (clustered sampling), the number of examples it trains on."""
    roster: dict[str, Any] = {protocol.NODE_KEY: node_key(context.node_config, context.node_id)}
    if protocol.ROSTER_EXAMPLES in msg.content[protocol.CONFIG]:
        from client_app import work

        from fedmm.config import client_run

        roster[protocol.NUM_EXAMPLES] = len(work.local_data(client_run(protocol.run_config_text(msg)), context))
    return protocol.reply_message(msg, {protocol.ROSTER: ConfigRecord(roster)})


def build_app(mods: Sequence[Any] = ()) -> ClientApp:
    """This ClientApp with Flower's ``mods`` around every handler (e.g. ``fixedclipping_mod``,
    ``adaptiveclipping_mod``, ``LocalDpMod(...)`` for client-side differential privacy,
    docs/privacy.md). Point ``simulation.client_app`` (``fedmm``) or pyproject.toml's
    ``clientapp`` (``flwr run``, a deployment) at a module attribute holding one. A ClientApp with
    mods trains one message at a time on the in-process engine (its mods see every message)."""
    client = ClientApp(mods=list(mods))
    client.train()(train)
    for action, handler in ((secure_protocol.SECURE_KEYS, secure_keys), (secure_protocol.SECURE_SEND, secure_send),
                            (secure_protocol.SECURE_RETURN, secure_return), (secure_protocol.SECURE_UPLOAD, secure_upload)):
        client.train(action)(handler)
    client.evaluate()(evaluate)
    client.query()(query)
    return client


#: The ClientApp (no mods): ``client_app.client_app:app``.
app = build_app()
