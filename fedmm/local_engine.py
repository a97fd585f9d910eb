"""The in-process simulation engine: a Flower ``Grid`` whose N virtual SuperNodes run a ClientApp
in the ServerApp's own process, one message at a time, without Ray.

    from fedmm.local_engine import run_local_simulation
    run_local_simulation(server_app=server_app, client_app=client_app, num_supernodes=100)

It takes the place of Flower's simulation engine (``flwr.simulation.run_simulation``, Ray
backend) for one machine and one device. What a strategy and a ClientApp see is what Flower's
simulation gives them:

- **nodes**: N virtual SuperNodes with random 63-bit node ids (as Flower draws them) and the node
  config Flower's simulation gives each (``partition-id``, ``num-partitions``); one ``Context``
  per node whose ``state`` persists across rounds. As in Flower's engine, a ClientApp call that
  raises leaves the node's context as it was before the call (Flower ships the context to a Ray
  actor and stores back only what a successful call returns), and a ClientApp may not change its
  ``run_config``;
- **messages** (:class:`LocalGrid`, a ``flwr.serverapp.Grid``): ``push_messages`` gives every
  message a fresh message id and checks it as Flower's in-memory grid and link state do (an
  invalid message raises ``ValueError``; one addressed to an unknown node is logged and gets no
  id); they are delivered in push order, ``delivered_at`` stamped, a message whose TTL ran out
  before its turn never; ``pull_messages`` returns each reply once, as a reply to its message
  (``reply_to_message_id``), and, for a message whose TTL ran out before its reply was pulled, or
  an id the grid does not know, Flower's "message unavailable" error reply; a reply whose own TTL
  ran out is Flower's "reply message unavailable" error. ``send_and_receive`` collects the
  replies until its timeout;
- **the ClientApp** is called through Flower's public call path, ``ClientApp.__call__(message,
  context)``, so its mods run as in any Flower runtime. An exception in it becomes the error
  reply Flower's engine makes of it (``ErrorCode.CLIENT_APP_RAISED_EXCEPTION``, the reason naming
  the exception and carrying its traceback), never an error in the server. A reply that is not a
  valid reply to its message (Flower's link state drops such a reply, and the server waits for it
  until its timeout) becomes an error reply naming what is wrong with it.

**No aliasing, one copy.** The server and the clients live in one process, so the engine keeps
them apart the way a transport does, with the least copying that takes: the ClientApp gets its
own records (new ``RecordDict``, ``ArrayRecord``, ``ConfigRecord``, ``Array`` objects) and its own
copy of every array's bytes, made when the message is delivered (a ClientApp that writes into
the buffer of its received model, e.g. through ``torch.frombuffer``, writes into its copy); the
server gets the reply's records anew around the bytes the ClientApp produced (no copy: nothing
the server does writes into them). A pushed message's records are released once it is
delivered. Flower's Ray engine serializes every message and context both ways instead.

**One thread.** The ServerApp runs in the calling thread, and each ClientApp call runs in it too,
when the server pulls (:class:`LocalGrid`): torch then works as in a plain training loop (a
second thread calling into torch gets a second OpenMP team and trained 1.3-1.5x slower here), a
stop signal reaches the ClientApp in training (the first sets fedmm's stop flag, which the
server's pull loop reads once that client is done; a second interrupts it), and the server's
timeouts hold between ClientApp calls, not inside one. Nothing here imports Ray.
"""

from __future__ import annotations

import copy
import secrets
import threading
import time
import weakref
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import DEBUG, ERROR, INFO
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import ClientAppException
from flwr.common.constant import MESSAGE_TTL_TOLERANCE, NUM_PARTITIONS_KEY, PARTITION_ID_KEY, SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log
from flwr.supercore.date import now
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

#: Flower's reasons for the error replies of its link state (``flwr.server.superlink.linkstate.utils``).
MESSAGE_UNAVAILABLE_REASON = (
    "Error: Message Unavailable - The requested message could not be found in the database. It may have "
    "expired due to its TTL, been deleted because the destination SuperNode was removed from the "
    "federation, or never existed."
)
REPLY_MESSAGE_UNAVAILABLE_REASON = "Error: Reply Message Unavailable - The reply message has expired."
#: Flower's message type of the link state's own error replies.
SYSTEM_MESSAGE_TYPE = "system"
#: A ClientApp's handler of several train messages at once: (messages, their nodes' contexts) ->
#: each one's reply, the exception its call would raise, or None (alone); or None (each alone).
TrainBatch = Callable[[Sequence[Message], Sequence[Context]], "Sequence[Message | BaseException] | None"]


# =============================================================================== records
def _array(array: Array, copy_bytes: bool) -> Array:
    data = array.data
    if copy_bytes or not isinstance(data, bytes):
        data = memoryview(data).tobytes()  # exactly one copy, a new object
    return Array(dtype=array.dtype, shape=tuple(array.shape), stype=array.stype, data=data)


def _value(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value  # scalars, str and bytes are immutable


def detached(content: RecordDict, copy_bytes: bool) -> RecordDict:
    """A ``RecordDict`` with the records of ``content`` that shares no mutable object with it:
    new records and ``Array`` objects, lists copied; each array's bytes copied when
    ``copy_bytes``, else shared (``bytes`` cannot be changed from Python)."""
    out = RecordDict()
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            fresh = ArrayRecord()
            for key, array in record.items():
                fresh[key] = _array(array, copy_bytes)
            out[name] = fresh
        elif isinstance(record, ConfigRecord):
            out[name] = ConfigRecord({key: _value(value) for key, value in record.items()})
        else:
            out[name] = MetricRecord({key: _value(value) for key, value in record.items()})
    return out


def _with_metadata(metadata: Any, content: RecordDict | None = None, error: Error | None = None) -> Message:
    fresh = copy.copy(metadata)
    return Message(metadata=fresh, content=content, error=error)


def _error_reply(metadata: Any, code: int, reason: str) -> Message:
    """An error reply to the message with ``metadata``, from its destination node, as Flower's
    engine makes one."""
    reply = Message(Error(code=code, reason=reason), reply_to=_with_metadata(metadata, RecordDict()))
    reply.metadata.__dict__["_message_id"] = str(uuid.uuid4())
    return reply


def _unavailable(message_id: str, run_id: int, ins: Any | None, reply_expired: bool) -> Message:
    """Flower's link-state error reply for a message that is gone, expired or unknown
    (``MESSAGE_UNAVAILABLE``), or whose reply expired (``REPLY_MESSAGE_UNAVAILABLE``)."""
    from flwr.app.metadata import Metadata

    current = now().timestamp()
    if reply_expired and ins is not None:
        metadata = Metadata(run_id=ins.run_id, message_id="", src_node_id=SUPERLINK_NODE_ID,
                            dst_node_id=SUPERLINK_NODE_ID, reply_to_message_id=ins.message_id,
                            group_id=ins.group_id, created_at=current,
                            ttl=max(ins.ttl - (current - ins.created_at), 0), message_type=ins.message_type,
                            src_task_id=ins.dst_task_id, dst_task_id=ins.src_task_id)
        error = Error(code=ErrorCode.REPLY_MESSAGE_UNAVAILABLE, reason=REPLY_MESSAGE_UNAVAILABLE_REASON)
    else:
        metadata = Metadata(run_id=run_id, message_id="", src_node_id=SUPERLINK_NODE_ID,
                            dst_node_id=SUPERLINK_NODE_ID, reply_to_message_id=message_id, group_id="",
                            created_at=current, ttl=0, message_type=SYSTEM_MESSAGE_TYPE)
        error = Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason=MESSAGE_UNAVAILABLE_REASON)
    metadata.__dict__["_message_id"] = str(uuid.uuid4())
    return Message(metadata=metadata, error=error)


def _expired(metadata: Any, current: float) -> bool:
    return metadata.created_at + metadata.ttl < current


def message_problems(message: Message, reply_to: Any | None = None) -> list[str]:
    """What makes ``message`` invalid as a server message (``reply_to`` None) or as the reply to
    the message with metadata ``reply_to``: the checks of Flower's link state
    (``flwr.server.utils.validator.validate_message`` and ``store_message_res``)."""
    problems: list[str] = []
    m = message.metadata
    if m.created_at < 1740700800.0:  # Flower's bound: 28 February 2025
        problems.append("`metadata.created_at` is not the unix time the message was created")
    if m.ttl <= 0:
        problems.append("`metadata.ttl` must be higher than zero")
    elif m.created_at + m.ttl <= time.time():
        problems.append("its TTL has expired")
    if not m.dst_node_id:
        problems.append("`metadata.dst_node_id` is not set")
    if not m.message_type:
        problems.append("`metadata.message_type` is not set")
    if message.has_content() == message.has_error():
        problems.append("it must carry content or an error (not both)")
    if reply_to is None:
        if m.reply_to_message_id:
            problems.append("`metadata.reply_to_message_id` must not be set")
        if m.src_node_id != SUPERLINK_NODE_ID:
            problems.append(f"`metadata.src_node_id` is not {SUPERLINK_NODE_ID} (the ServerApp's node id)")
        return problems
    if m.reply_to_message_id != reply_to.message_id:
        problems.append(f"it replies to message {m.reply_to_message_id!r}, not {reply_to.message_id!r} "
                        "(build it with Message(content, reply_to=message))")
    if m.src_node_id != reply_to.dst_node_id:
        problems.append(f"it comes from node {m.src_node_id}, not from {reply_to.dst_node_id}")
    if m.dst_node_id != SUPERLINK_NODE_ID:
        problems.append(f"it is addressed to node {m.dst_node_id}, not to the ServerApp ({SUPERLINK_NODE_ID})")
    if m.run_id != reply_to.run_id:
        problems.append(f"its run id {m.run_id} is not the message's {reply_to.run_id}")
    allowed = reply_to.created_at + reply_to.ttl - m.created_at
    if m.ttl and m.ttl - allowed > MESSAGE_TTL_TOLERANCE:
        problems.append(f"its TTL {m.ttl:.2f} exceeds the {allowed:.2f} s left to the message")
    return problems


def raised_reason(err: BaseException) -> str:
    """The reason of the error reply for a ClientApp that raised ``err``: Flower's engine's
    format for a ``ClientAppException`` (``<class '...'>:<'...'>``), whose message holds the
    ClientApp's own exception line first, then its traceback (as Ray's does)."""
    own = "".join(traceback.format_exception_only(type(err), err)).strip()
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__)).strip()
    wrapped = ClientAppException(f"{own}\n\n{trace}")
    return f"{type(wrapped)}:<'{wrapped}'>"


# =============================================================================== global random state
class RandomStates:
    """The process's global random generators (Python's ``random``, NumPy's global generator,
    torch's default CPU generator and, once CUDA is initialised, its CUDA generators): captured
    with :meth:`capture`, put back with :meth:`restore`.

    Ray runs ClientApps in their own processes, so what a ClientApp does to the global generators
    (``torch.manual_seed`` before its batches, a ``random.seed`` in a user's ClientApp) never
    reaches the ServerApp's. The in-process engine keeps the two apart the same way: the clients
    draw from one set of global states, the server from its own, swapped around every ClientApp
    call. (Server code that draws from a global generator while a client runs would draw from the
    clients' states: no strategy of this project does; they draw from generators of their own.)
    """

    def __init__(self, states: tuple[Any, ...]) -> None:
        self.states = states

    @classmethod
    def capture(cls) -> RandomStates:
        import random
        import sys

        import numpy as np

        torch = sys.modules.get("torch")
        cpu = torch.random.get_rng_state() if torch is not None else None
        cuda = torch.cuda.get_rng_state_all() if torch is not None and torch.cuda.is_initialized() else None
        return cls((random.getstate(), np.random.get_state(), cpu, cuda))

    def restore(self) -> None:
        import random
        import sys

        import numpy as np

        python, numpy_state, cpu, cuda = self.states
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch = sys.modules.get("torch")
        if torch is not None and cpu is not None:
            torch.random.set_rng_state(cpu)
        if torch is not None and cuda is not None and torch.cuda.is_initialized():
            torch.cuda.set_rng_state_all(cuda)


# =============================================================================== the grid
@dataclass
class _Pending:
    """A pushed message: its metadata, its records until it is delivered, then its reply."""

    metadata: Any
    message: Message | None
    reply: Message | None = None


class LocalGrid(Grid):
    """A Flower ``Grid`` over N virtual SuperNodes that run ``client_app`` in this process.

    Parameters
    ----------
    client_app : ClientApp
        The ClientApp every node runs (called as ``client_app(message, context)``).
    num_supernodes : int
        N: the virtual SuperNodes, with partition ids 0 .. N-1.
    run : Run, optional
        The run (default: a new run id, as Flower's ``run_simulation`` makes one).
    run_config : mapping, optional
        Every node's ``Context.run_config`` (Flower's simulation of app objects: empty).
    node_ids : list of int, optional
        The nodes' ids in partition order (default: random, as Flower draws them); e.g. those of
        another simulation, to run it again with the same ids.

    The ClientApp runs in the thread that pulls: ``pull_messages`` delivers the pushed messages
    in push order, one ClientApp call each, until one of the messages it is asked about has its
    reply (the strategies' pull loops then decode each reply as it comes, as on Flower's engine).
    A message the server no longer waits for (a timed-out phase's) is still delivered in its turn,
    as Flower's engine works through its queue whoever waits.

    With ``train_batch`` (the ClientApp's handler of several train messages, e.g.
    :func:`client_app.vectorized.train_messages`), the train messages queued one after another
    are delivered together: ``train_batch(messages, contexts)`` returns each one's reply, or the
    exception its ClientApp call would have raised (an error reply, as above), or None for "this
    one alone" (it goes through the ClientApp as usual), or None instead of the list for "each
    alone". Each message is delivered as
    one alone would be (its TTL, its own records, its node's context, kept only on success). The
    batch handler stands for the ClientApp's train handler itself: a ClientApp whose train messages
    pass through mods (``ClientApp(mods=...)`` or ``@app.train(mods=...)``: Flower's clipping and
    local-DP mods, say) is never batched; every message goes through ``ClientApp.__call__`` and
    its mods, one at a time (said once in the log).
    """

    def __init__(self, client_app: ClientApp, num_supernodes: int, run: Run | None = None,
                 run_config: Mapping[str, Any] | None = None, node_ids: list[int] | None = None,
                 train_batch: TrainBatch | None = None) -> None:
        if not isinstance(client_app, ClientApp):
            raise TypeError(f"client_app must be a flwr ClientApp, got {type(client_app).__name__}")
        if isinstance(num_supernodes, bool) or not isinstance(num_supernodes, int) or num_supernodes < 1:
            raise ValueError(f"num_supernodes must be an integer >= 1, got {num_supernodes!r}")
        self.client_app = client_app
        if run is None:
            run = Run.create_empty(run_id=secrets.randbits(63) or 1)
        self._run = run
        self._run_config = dict(run_config or {})
        ids: list[int] = []
        if node_ids is not None:
            ids = [int(n) for n in node_ids]
            if len(ids) != num_supernodes or len(set(ids)) != len(ids) or any(n in (0, SUPERLINK_NODE_ID) or n < 0 for n in ids):
                raise ValueError(f"node_ids must be {num_supernodes} distinct ids other than 0 and {SUPERLINK_NODE_ID}, "
                                 f"got {node_ids!r}")
        while len(ids) < num_supernodes:  # distinct, never the ServerApp's own id
            node_id = secrets.randbits(63)
            if node_id not in (0, SUPERLINK_NODE_ID) and node_id not in ids:
                ids.append(node_id)
        self._contexts = {
            node_id: Context(run_id=run.run_id, node_id=node_id,
                             node_config={PARTITION_ID_KEY: partition, NUM_PARTITIONS_KEY: num_supernodes},
                             state=RecordDict(), run_config=dict(self._run_config))
            for partition, node_id in enumerate(ids)
        }
        self._pending: dict[str, _Pending] = {}
        self._queue: deque[str] = deque()
        #: The messages the ClientApp holds right now (its own copies, while a call runs): with
        #: :meth:`held_messages` what the engine holds of the server's messages (memory diagnostics).
        self.delivering: list[Message] = []
        _LIVE.add(self)
        self._lock = threading.RLock()
        #: The clients' side of the global random generators (see :class:`RandomStates`).
        self._client_random: RandomStates | None = None
        self.messages_handled = 0
        #: The ClientApp's handler of several train messages at once (see the class docstring); None
        #: when the ClientApp's train messages pass through mods, which it would skip.
        self.train_batch = train_batch if train_batch is None or not train_mods(client_app) else None
        if train_batch is not None and self.train_batch is None:
            log(INFO, "In-process simulation: the ClientApp's train handler has mods; its train messages are "
                "delivered one at a time through them (never batched)")

    # ------------------------------------------------------------------ Grid API
    def set_run(self, run: Run) -> None:
        """Operate in ``run`` (its id becomes the nodes' run id)."""
        if not isinstance(run, Run):
            raise TypeError(f"`run` must be an instance of Run, got {type(run).__name__}")
        self._run = run
        for context in self._contexts.values():
            context.run_id = run.run_id

    @property
    def run(self) -> Run:
        """The run (a copy)."""
        return Run(**vars(self._run))

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        """A new message (Flower deprecates this in favour of ``Message(...)``)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        """The node ids, in partition order."""
        return list(self._contexts)

    def context(self, node_id: int) -> Context:
        """The ``Context`` node ``node_id`` keeps across rounds."""
        return self._contexts[node_id]

    def held_messages(self) -> list[Message]:
        """The messages the grid holds now: pushed ones not yet delivered, replies not yet pulled
        (a ClientApp's own copy of the message it is handling is not among them). May be called
        from another thread; the list is a snapshot."""
        pending = list(self._pending.values())
        return [m for p in pending for m in (p.message, p.reply) if m is not None]

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Give each message an id and queue it for its node (see the module docstring)."""
        ids: list[str] = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            m = message.metadata
            if not (m.message_id and not m.reply_to_message_id and m.ttl > 0 and m.delivered_at == ""):
                raise ValueError(f"Invalid message: {message}")
            problems = message_problems(message)
            if m.run_id != self._run.run_id:
                problems.append(f"its run id {m.run_id} is not this run's {self._run.run_id}")
            if m.dst_node_id not in self._contexts:
                problems.append(f"its destination node {m.dst_node_id} is not a node of this federation")
            if problems:
                log(ERROR, "Invalid message to node %s: %s", m.dst_node_id, "; ".join(problems))
                continue
            with self._lock:
                self._pending[m.message_id] = _Pending(m, message)
                self._queue.append(m.message_id)
            ids.append(m.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """Deliver queued messages until one of ``message_ids`` has its reply (see the class
        docstring); then the replies that are in, each once, and Flower's error replies for
        messages that expired or that the grid does not know (see the module docstring)."""
        wanted = set(message_ids)
        with self._lock:
            self._deliver_until_a_reply(wanted)
            current = time.time()
            replies: list[Message] = []
            for message_id in wanted:
                pending = self._pending.get(message_id)
                if pending is None or _expired(pending.metadata, current):
                    self._pending.pop(message_id, None)
                    replies.append(_unavailable(message_id, self._run.run_id, None, False))
                elif pending.reply is not None:
                    del self._pending[message_id]
                    reply = pending.reply
                    if _expired(reply.metadata, current):
                        reply = _unavailable(message_id, self._run.run_id, pending.metadata, True)
                    reply.metadata.delivered_at = now().isoformat()
                    replies.append(reply)
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Push ``messages``, then deliver them and collect the replies until all are in or
        ``timeout`` seconds pass (None: no limit)."""
        waiting = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while waiting and (deadline is None or time.monotonic() < deadline):
            got = self.pull_messages(waiting)
            replies.extend(got)
            waiting.difference_update(r.metadata.reply_to_message_id for r in got)
            if not got:
                break  # nothing left to deliver for them
        return replies

    # ------------------------------------------------------------------ delivery
    def _deliver_until_a_reply(self, wanted: set[str]) -> None:
        def waiting() -> bool:
            entries = [self._pending.get(i) for i in wanted]
            return not any(e is not None and e.reply is not None for e in entries) and any(
                e is not None and e.message is not None for e in entries)

        while self._queue and waiting():
            head = self._queue.popleft()
            if self.train_batch is not None and self._is_train(head) and self._queue and self._is_train(self._queue[0]):
                batch = [head]
                while self._queue and self._is_train(self._queue[0]):
                    batch.append(self._queue.popleft())
                self._deliver_together(batch)
            else:
                self._deliver(head)

    def _is_train(self, message_id: str) -> bool:
        pending = self._pending.get(message_id)
        return (pending is not None and pending.message is not None and pending.message.has_content()
                and pending.metadata.message_type == MessageType.TRAIN)

    def _deliver_together(self, message_ids: list[str]) -> None:
        """Deliver train messages through ``train_batch`` (see the class docstring)."""
        taken: list[tuple[_Pending, Any, Message]] = []
        for message_id in message_ids:
            pending = self._pending.get(message_id)
            if pending is None or pending.message is None:
                continue
            ins, pending.message = pending.message, None
            if _expired(ins.metadata, time.time()):
                continue
            ins.metadata.delivered_at = now().isoformat()
            # the handler is fedmm's, which never writes into a received array: no copy of the bytes
            taken.append((pending, ins.metadata, _with_metadata(ins.metadata, detached(ins.content, copy_bytes=False))))
            del ins
        contexts = [self._node_context(metadata.dst_node_id) for _, metadata, _ in taken]
        server_random = RandomStates.capture()
        if self._client_random is not None:
            self._client_random.restore()
        self.delivering = [delivered for _, _, delivered in taken]
        try:
            outs = self.train_batch(list(self.delivering), contexts)
        except Exception as err:  # noqa: BLE001 - the handler's failure: each node's error reply
            outs = [err] * len(taken)
        finally:
            self.delivering = []
            self._client_random = RandomStates.capture()
            server_random.restore()
        for index in range(len(taken)):
            # each message's records are released as soon as its reply is made (the others' still
            # wait): one at a time, the round holds one message's arrays, not all of them
            pending, metadata, delivered = taken[index]
            taken[index] = None  # type: ignore[call-overload]
            if outs is None or outs[index] is None:  # one at a time, through the ClientApp, with its own copy
                try:
                    own = _with_metadata(metadata, detached(delivered.content, copy_bytes=True))
                    del delivered
                    reply = self._handle(metadata, own)
                except Exception as err:  # noqa: BLE001 - the engine's own failure: the node's error reply
                    reply = _error_reply(metadata, ErrorCode.UNKNOWN, raised_reason(err))
            elif isinstance(outs[index], BaseException):
                err = outs[index]
                log(ERROR, "ClientApp of node %s raised %s: %s", metadata.dst_node_id, type(err).__name__, err)
                reply = _error_reply(metadata, ErrorCode.CLIENT_APP_RAISED_EXCEPTION, raised_reason(err))
            else:
                reply = self._settle(metadata, contexts[index], outs[index])
            self.messages_handled += 1
            pending.reply = reply

    def _deliver(self, message_id: str) -> None:
        """Run the ClientApp on message ``message_id`` and keep its reply."""
        pending = self._pending.get(message_id)
        if pending is None or pending.message is None:
            return  # pulled (as unavailable) before its turn
        ins, pending.message = pending.message, None  # the grid releases the server's records
        if _expired(ins.metadata, time.time()):
            return  # never delivered: a pull answers "message unavailable"
        ins.metadata.delivered_at = now().isoformat()
        metadata = ins.metadata
        try:
            delivered = _with_metadata(metadata, detached(ins.content, copy_bytes=True)) if ins.has_content() \
                else _with_metadata(metadata, error=ins.error)
            del ins  # from here on the client holds its own copy only
            reply = self._handle(metadata, delivered)
        except Exception as err:  # noqa: BLE001 - the engine's own failure: the node's error reply
            reply = _error_reply(metadata, ErrorCode.UNKNOWN, raised_reason(err))
        self.messages_handled += 1
        pending.reply = reply

    def _node_context(self, node_id: int) -> Context:
        """A copy of node ``node_id``'s context for one ClientApp call (kept if the call succeeds)."""
        stored = self._contexts[node_id]
        return Context(run_id=stored.run_id, node_id=node_id, node_config=dict(stored.node_config),
                       state=detached(stored.state, copy_bytes=False), run_config=dict(stored.run_config))

    def _handle(self, metadata: Any, delivered: Message) -> Message:
        """Run the ClientApp on ``delivered`` (the node's own copy of the message with
        ``metadata``) and on a copy of its node's context; the reply, or the error reply
        Flower's engine would make."""
        node_id = metadata.dst_node_id
        context = self._node_context(node_id)
        server_random = RandomStates.capture()
        if self._client_random is not None:
            self._client_random.restore()
        self.delivering = [delivered]
        try:
            out = self.client_app(delivered, context)
        except Exception as err:  # noqa: BLE001 - a ClientApp's failure is its node's error reply
            log(ERROR, "ClientApp of node %s raised %s: %s", node_id, type(err).__name__, err)
            return _error_reply(metadata, ErrorCode.CLIENT_APP_RAISED_EXCEPTION, raised_reason(err))
        except (KeyboardInterrupt, SystemExit):
            raise  # a stop signal (raised in this thread, where the ClientApp runs), or an exit: not the node's
        except BaseException as err:  # e.g. GeneratorExit: a Ray actor would die of it: the node's error
            return _error_reply(metadata, ErrorCode.CLIENT_APP_CRASHED, raised_reason(err))
        finally:
            self.delivering = []
            self._client_random = RandomStates.capture()
            server_random.restore()
        del delivered
        return self._settle(metadata, context, out)

    @staticmethod
    def live() -> list[LocalGrid]:
        """The grids of this process that are alive (memory diagnostics: ``bench/scale.py``)."""
        return list(_LIVE)

    def state_bytes(self) -> dict[int, int]:
        """The bytes of the arrays each node's ``Context.state`` keeps across rounds (what a
        stateful client method such as SCAFFOLD or FedDyn keeps per client), by node id, for the
        nodes that keep any (memory diagnostics: ``bench/scale.py``)."""
        held = {}
        for node_id, context in list(self._contexts.items()):
            size = sum(record.count_bytes() for record in list(context.state.array_records.values()))
            if size:
                held[node_id] = size
        return held

    def _settle(self, metadata: Any, context: Context, out: Any) -> Message:
        """The reply to the message with ``metadata`` from what its ClientApp call returned
        (``out``) with ``context``: checked as Flower's engine checks it; the context becomes the
        node's only when the call succeeded."""
        node_id = metadata.dst_node_id
        if context.run_config != self._run_config:
            reason = (f"<class 'ValueError'>:<'The `run_config` field of the `Context` object cannot be modified "
                      f"(run_id: {context.run_id}).'>")
            return _error_reply(metadata, ErrorCode.UNKNOWN, reason)
        if not isinstance(out, Message):
            return _error_reply(metadata, ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                f"<class 'TypeError'>:<'the ClientApp returned {type(out).__name__}, not a Message'>")
        out.metadata.__dict__["_message_id"] = str(uuid.uuid4())
        problems = message_problems(out, reply_to=metadata)
        if problems:
            return _error_reply(metadata, ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                f"<class 'ValueError'>:<'invalid reply from the ClientApp: {'; '.join(problems)}'>")
        self._contexts[node_id] = context  # the call succeeded: its context is the node's now
        if out.has_content():
            return _with_metadata(out.metadata, detached(out.content, copy_bytes=False))
        return _with_metadata(out.metadata, error=Error(code=out.error.code, reason=out.error.reason))

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Drop every message not yet pulled (undelivered ones are never delivered)."""
        with self._lock:
            self._queue.clear()
            self._pending.clear()

    def __enter__(self) -> LocalGrid:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: Every LocalGrid alive in this process (:meth:`LocalGrid.live`).
_LIVE: weakref.WeakSet = weakref.WeakSet()


def train_mods(client_app: ClientApp) -> bool:
    """Whether ``client_app``'s default train messages pass through mods: the app's own
    (``ClientApp(mods=...)``) or the handler's (``@app.train(mods=...)``), which Flower wraps
    around the handler with :func:`flwr.client.mod.utils.make_ffn`."""
    from flwr.client.mod.utils import make_ffn

    handler = client_app._registered_funcs.get(f"{MessageType.TRAIN}.default")  # noqa: SLF001 - Flower keeps them there
    return bool(client_app._mods) or (handler is not None and handler.__module__ == make_ffn.__module__)  # noqa: SLF001


# =============================================================================== the runtime
def run_local_simulation(server_app: ServerApp, client_app: ClientApp, num_supernodes: int,
                         run_config: Mapping[str, Any] | None = None, node_ids: list[int] | None = None,
                         train_batch: TrainBatch | None = None) -> Context:
    """Run ``server_app`` in this thread against ``num_supernodes`` virtual SuperNodes that run
    ``client_app`` in this process (the in-process counterpart of Flower's ``run_simulation``);
    return the ServerApp's context. An exception of the ServerApp propagates. ``run_config``,
    ``node_ids`` and ``train_batch``: as :class:`LocalGrid` takes them."""
    grid = LocalGrid(client_app, num_supernodes, run_config=run_config, node_ids=node_ids, train_batch=train_batch)
    run = grid.run
    context = Context(run_id=run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=dict(run_config or {}))
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    # Messages the ServerApp builds take the run and node identity of the running task.
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run.run_id, SUPERLINK_NODE_ID
    log(INFO, "In-process simulation: %d virtual SuperNodes, their ClientApp in this process", num_supernodes)
    try:
        with grid:
            server_app(grid=grid, context=context)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
        log(DEBUG, "In-process simulation: %d messages handled", grid.messages_handled)
    return context
