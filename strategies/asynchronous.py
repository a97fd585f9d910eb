"""Asynchronous rounds: the event loop FedBuff and the asynchronous FedMR / FedCross share.

There is no round barrier. A **job** is one model sent to one free client; the server keeps up to
a number of jobs in flight (FedBuff: its concurrency; the multi-model methods: one per model) on
Flower's non-blocking ``Grid.push_messages`` / ``Grid.pull_messages``, handles the jobs as they
end, and after every ``B`` of them applies the method's operation (a server step, a
recombination, a cross-aggregation). For the runner one such aggregation is one "round":
``evaluate_fn``, the ``metrics.jsonl`` row and checkpoints happen after each.

Order (docs/async.md, "Ordering"). On the virtual clock (``heterogeneity.clock: virtual``, the
simulation) every job gets a virtual finish time when it is dispatched (dispatch time + its
modelled duration, :mod:`strategies.heterogeneity`), and the server handles the jobs in
finish-time order, ties by job number: it waits for the reply of the earliest job even when
others are in first, so a run does not depend on how busy the machine is. On the real clock
(a deployment) it handles replies as they arrive.

Faults. A reply is decoded and checked as the synchronous strategies check theirs
(:func:`fedmm.protocol.decode_train_reply`, the ``num-examples`` bound); a client error, a bad
reply, no reply within ``round_timeout`` seconds, a client that goes offline or a job past the
``deadline`` ends the job as *failed* (logged with the node), and the method decides what that
means (FedBuff: the update is lost; multi-model: the model comes back as it was sent).

Dispatch. The clients of a dispatch are drawn among the free (and, on the virtual clock, online)
nodes ordered by their stable keys, with ``rng(seed, round)`` for the first draw after an
aggregation (``round`` = aggregations + 1, what the synchronous selector uses, so a draw among
all nodes is the synchronous sample) and ``rng(seed, round, 2, n)`` for the n-th further one.

Resume. :meth:`AsyncRoundLoop.state_dict` holds the jobs in flight (node key, model, version,
times), never a reply; after a resume they are sent again, to the node with the same key, with
the same model and config, so a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.supercore import log

from fedmm import protocol
from fedmm.errors import ConfigError
from fedmm.interrupt import STOP, raise_if_stopped
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Int, Nullable, setting
from strategies.base import RoundLoopStrategy, RunFailed
from strategies.ledger import ReplyCheck
from strategies.messaging import POLL_INTERVAL
from strategies.selection import SeededRosterSelector

#: rng stream of the dispatch draws after the first of a round (0: training, 1: evaluation).
ASYNC_STREAM = 2


def buffer_setting(what: str, of: str) -> Any:
    """The ``buffer_size`` setting (B) of an asynchronous method."""
    return setting(None, Nullable(Int(min=1), "null (half, rounded up) or an integer >= 1"),
                   f"B: {what} per aggregation (null: half of {of}, rounded up)", label="B {}")


def max_staleness_setting(what: str) -> Any:
    """The ``max_staleness`` setting of an asynchronous method."""
    return setting(None, Nullable(Int(min=0), "null (no bound) or an integer >= 0"),
                   f"{what} when its client trained on a copy more than this many aggregations old (null: no bound)",
                   label="max staleness {}")


def half(n: int) -> int:
    """⌈n / 2⌉, at least 1: B's default."""
    return max(1, math.ceil(n / 2))


def check_async(settings: Any, run: Any, buffer_of: int | None = None) -> None:
    """Rules every asynchronous method has: uniform draws, modelled work on the virtual clock,
    B at most ``buffer_of``."""
    if run.selection.name != "uniform":
        raise ConfigError("selection", run.selection.name, f"uniform with strategy={settings.option} (an asynchronous "
                          "strategy draws each job's client among the free ones)")
    h = settings.heterogeneity
    if h.clock == "virtual" and h.work == "measured":
        raise ConfigError("strategy.heterogeneity.work", h.work, f"modelled with strategy={settings.option} on the "
                          "virtual clock (jobs are ordered by their durations before their replies are in)")
    if buffer_of is not None and settings.buffer_size is not None and settings.buffer_size > buffer_of:
        raise ConfigError("strategy.buffer_size", settings.buffer_size, f"at most {buffer_of} (clients_per_round: the "
                          "models of the run)")


@dataclass
class Job:
    """One model sent to one client."""

    id: int
    node: int
    key: str
    model_index: int  # the model it carries (FedBuff: 0)
    version: int  # aggregations the server had made when it was sent
    server_round: int  # the ``server-round`` it was sent with (version + 1)
    repeat: int  # earlier jobs of this node with the same server-round
    start: float  # virtual time it was sent at
    duration: float | None = None  # virtual seconds (None: not known before its reply)
    finish: float | None = None  # when it ends on the virtual clock
    lost: str = ""  # why it fails whatever the client sends (offline, past the deadline), known in advance
    # not saved: this process's message and what came back
    message_id: str | None = field(default=None, repr=False)
    pushed_at: float = field(default=0.0, repr=False)
    replied: bool = field(default=False, repr=False)
    arrived_at: float = field(default=0.0, repr=False)
    update: ClientUpdate | None = field(default=None, repr=False)
    reason: str = field(default="", repr=False)

    SAVED = ("id", "node", "key", "model_index", "version", "server_round", "repeat", "start", "duration", "finish", "lost")

    def saved(self) -> dict[str, Any]:
        return {name: value for name, value in asdict(self).items() if name in self.SAVED}

    @property
    def failure(self) -> str:
        """Why the job failed, or ``""``."""
        return self.lost or ("" if self.update is not None else self.reason or "no reply")


class AsyncRoundLoop(RoundLoopStrategy):
    """The asynchronous event loop on top of :class:`~strategies.base.RoundLoopStrategy`.

    A method says which models go out (:meth:`wanted`, :meth:`payload`), what an ended job does
    (:meth:`arrive`, True when the round is over) and what a round returns (:meth:`close`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Aggregations so far (the version of the server's models).
        self.version = 0
        #: Jobs in flight, by number.
        self.jobs: dict[int, Job] = {}
        self.next_job = 1
        #: Dispatch draws since the last aggregation (the rng stream of the next one).
        self.draws = 0
        #: node key -> [server-round, jobs sent with it] (the ``round-repeat`` of its next job).
        self.repeats: dict[str, list[int]] = {}
        #: node key -> num-examples of its last valid reply (its size when the roster gives none).
        self.sizes: dict[str, float] = {}
        #: Jobs that failed this round (reasons), for the log and ``max_failed_rounds``.
        self.failures: list[str] = []
        self.num_rounds: int | None = None
        self._by_message: dict[str, int] = {}
        self._encoded: dict[tuple[int, int], ArrayRecord] = {}
        self._train_config: ConfigRecord = ConfigRecord()

    @classmethod
    def from_settings(cls, run: Any) -> AsyncRoundLoop:
        """The strategy of a run; the roster query asks the nodes for their sizes too (the
        virtual clock gives a job its duration when it is sent)."""
        strategy = super().from_settings(run)
        strategy.selector = SeededRosterSelector(
            run.seed, query_config={protocol.ROSTER_EXAMPLES: 1, protocol.RUN_CONFIG: protocol.run_config_record(run)})
        return strategy  # type: ignore[return-value]

    # ================================================================== method hooks
    def minimum_nodes(self) -> int:
        """Nodes that must be connected before the first dispatch."""
        return self.clients_per_round

    def buffer(self) -> int:
        """B: what ends a round (FedBuff: accepted updates; multi-model: models back)."""
        raise NotImplementedError

    def wanted(self) -> list[int]:
        """The models (indices) to send now, in order, as far as free clients allow."""
        raise NotImplementedError

    def payload(self, job: Job) -> ModelDict:
        """The model ``job`` carries (the same on every call: a resumed job is sent again)."""
        raise NotImplementedError

    def sent(self, job: Job) -> None:
        """Called when a job is made."""

    def arrive(self, server_round: int, job: Job) -> bool:
        """Handle an ended job (``job.update``, or ``job.failure``); True when the round is over."""
        raise NotImplementedError

    def close(self, server_round: int) -> tuple[ArrayRecord | None, Any]:
        """The round's result after :meth:`arrive` said it is over: (global arrays, train metrics)."""
        raise NotImplementedError

    # ================================================================== the loop
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, *args: Any, **kwargs: Any) -> Any:
        """As :meth:`RoundLoopStrategy.start`; no job is sent after the last aggregation."""
        self.num_rounds = num_rounds
        self.clock.restart()
        return super().start(grid, initial_arrays, num_rounds, *args, **kwargs)

    def run_round(self, server_round, grid, arrays, config, timeout):  # type: ignore[no-untyped-def]
        """Handle ended jobs, sending new ones, until the next aggregation (one "round")."""
        self.begin_round(arrays)
        self.failures = []
        self._train_config = config
        self.resend(grid)
        self.dispatch(grid)
        while True:
            job = self.next_ended(grid, timeout)
            del self.jobs[job.id]
            if job.failure:
                self.failures.append(f"{self.name_job(job)}: {job.failure}")
                log(WARNING, "\t> job failed: %s", self.failures[-1])
            elif job.update is not None:
                self.sizes[job.key] = job.update.num_examples
            if self.arrive(server_round, job):
                break
            self.dispatch(grid)
        self.last_round.rejections = list(self.failures)
        self.round_log.update({"virtual_time": self.clock.now, "in_flight": float(len(self.jobs))})
        version = self.version
        result = self.close(server_round)
        if self.version != version:  # a new round number: its draws start at stream 0 again
            self.draws = 0
        self._encoded = {k: v for k, v in self._encoded.items() if k[0] == self.version}
        if self.num_rounds is None or server_round < self.num_rounds:
            self.dispatch(grid)
        return result

    def summary(self) -> None:
        """The base summary plus the asynchronous loop's numbers."""
        super().summary()
        log(INFO, "\t└──> Asynchronous: B=%d per aggregation, at most %d jobs in flight, %s clock",
            self.buffer(), self.minimum_nodes(), self.clock.settings.clock)

    def name_job(self, job: Job) -> str:
        models = len(self.models or []) > 1
        return f"node {job.node} (job {job.id}" + (f", model {job.model_index})" if models else ")")

    def roster(self, grid: Grid) -> list[int]:
        """The connected nodes ordered by their stable keys (as the selector orders them)."""
        return list(self.selector.ordered_nodes(grid, self.minimum_nodes()))

    def dispatch(self, grid: Grid) -> None:
        """Send the wanted models to free clients, drawn at random (module docstring)."""
        wanted = self.wanted()
        if not wanted:
            return
        nodes = self.roster(grid)
        self.clock.set_roster([self.selector.node_key(n) for n in nodes])
        now = self.clock.now if self.clock.virtual else self.clock.wall_now()
        busy = {job.node for job in self.jobs.values()}
        free = [n for n in nodes if n not in busy and self.clock.online(self.selector.node_key(n), now)]
        count = min(len(wanted), len(free))
        if count == 0:
            return
        rng = np.random.default_rng([self.seed, self.version + 1] + ([ASYNC_STREAM, self.draws] if self.draws else []))
        self.draws += 1
        picked = [free[i] for i in rng.choice(len(free), size=count, replace=False)]
        jobs = [self.new_job(index, node, now) for index, node in zip(wanted, picked)]
        self.push(grid, [job for job in jobs if not job.lost])

    def new_job(self, model_index: int, node: int, now: float) -> Job:
        key = self.selector.node_key(node)
        server_round = self.version + 1
        last = self.repeats.get(key)
        repeat = last[1] if last and last[0] == server_round else 0
        self.repeats[key] = [server_round, repeat + 1]
        job = Job(self.next_job, node, key, model_index, self.version, server_round, repeat, now)
        self.next_job += 1
        if self.clock.virtual:
            size = self.selector.num_examples(node)
            self.time(job, self.clock.duration(key, size if size is not None else self.sizes.get(key)))
        self.jobs[job.id] = job
        self.sent(job)
        return job

    def time(self, job: Job, duration: float | None) -> None:
        """Give ``job`` its duration, hence its finish time (or the moment it is lost)."""
        if duration is None:
            return
        job.duration = duration
        job.finish, job.lost = self.clock.cut(job.key, job.start, duration)

    def message(self, job: Job) -> Message:
        cache = (job.version, job.model_index)
        if cache not in self._encoded:
            self._encoded[cache] = protocol.model_to_record(self.payload(job))
        config = {**dict(self._train_config), protocol.SERVER_ROUND: job.server_round, protocol.MODEL_INDEX: job.model_index,
                  protocol.ACCEPTED_ROUND: self.replies.accepted_rounds.get(job.node, 0)}
        if job.repeat:
            config[protocol.ROUND_REPEAT] = job.repeat
        return protocol.server_message(
            protocol.TRAIN, job.node, config, self._encoded[cache], self.extra_records(job.server_round, job.model_index),
            arrays_key=self.arrayrecord_key, config_key=self.configrecord_key,
        )

    def push(self, grid: Grid, jobs: list[Job]) -> None:
        if not jobs:
            return
        messages = [self.message(job) for job in jobs]
        pushed = set(grid.push_messages(messages))
        moment = time.monotonic()
        for job, message in zip(jobs, messages):
            if message.metadata.message_id in pushed:
                job.message_id, job.pushed_at = message.metadata.message_id, moment
                self._by_message[job.message_id] = job.id
            else:
                job.replied, job.reason, job.arrived_at = True, "the message could not be sent", moment
        messages.clear()

    def resend(self, grid: Grid) -> None:
        """Jobs restored from a checkpoint: send them again, to the node with the same key."""
        restored = [job for job in self.jobs.values() if job.message_id is None and not job.replied and not job.lost]
        if not restored:
            return
        nodes = {self.selector.node_key(n): n for n in self.roster(grid)}
        for job in restored:
            if job.key in nodes:
                job.node = nodes[job.key]
            else:
                job.replied, job.reason = True, "its node is not connected after the resume"
        self.push(grid, [job for job in restored if not job.replied])

    def receive(self, job: Job, reply: Message) -> None:
        """Decode and check a reply as the synchronous strategies do (:class:`~strategies.ledger.ReplyCheck`)."""
        update, reason = ReplyCheck.of(self, job.server_round).check(reply, job.model_index, job.node)
        job.update, job.reason, job.replied, job.arrived_at = update, reason, True, time.monotonic()
        if self.clock.virtual and job.duration is None:
            self.time(job, self.clock.duration(job.key, update.num_examples if update is not None else None))

    def pull(self, grid: Grid) -> None:
        waiting = [job.message_id for job in self.jobs.values() if job.message_id and not job.replied]
        if not waiting:
            return
        replies = list(grid.pull_messages(waiting))
        while replies:
            reply = replies.pop(0)
            job = self.jobs.get(self._by_message.pop(reply.metadata.reply_to_message_id, -1))
            if job is not None and not job.replied:
                self.receive(job, reply)
            del reply

    def next_ended(self, grid: Grid, timeout: float) -> Job:
        """The next job to handle (module docstring, "Order"), waiting for it as long as needed."""
        while True:
            raise_if_stopped()
            self.pull(grid)
            moment = time.monotonic()
            for job in self.jobs.values():
                if job.message_id and not job.replied and moment - job.pushed_at >= timeout:
                    job.replied, job.reason, job.arrived_at = True, f"no reply within {timeout:g}s", moment
            job = self.due()
            if job is not None and self.clock.virtual:
                ends = job.finish if job.finish is not None else self.clock.now
                wake = self.wake(grid)
                if wake < ends:  # a free client comes online first: it gets a job then
                    self.clock.now = wake
                    self.dispatch(grid)
                    continue
                self.clock.now = max(self.clock.now, ends)
            if job is not None:
                return job
            if not self.jobs:
                self.idle(grid)
                continue
            if STOP.wait(POLL_INTERVAL):
                raise_if_stopped()

    def due(self) -> Job | None:
        """The job whose end comes next, if it can be handled now."""
        jobs = list(self.jobs.values())
        if not jobs:
            return None
        if not self.clock.virtual:  # arrival order
            ended = [job for job in jobs if job.replied]
            if not ended:
                return None
            self.clock.wall_now()
            return min(ended, key=lambda job: (job.arrived_at, job.id))
        if any(job.finish is None and not job.replied for job in jobs):
            return None  # a job's duration is not known yet: it may end first
        first = min(jobs, key=lambda job: (job.finish if job.finish is not None else self.clock.now, job.id))
        return first if first.replied or first.lost else None

    def wake(self, grid: Grid) -> float:
        """Virtual clock with availability: when the first free offline client comes online,
        if a model waits for one (inf otherwise)."""
        if not self.clock.settings.offline_fraction or not self.wanted():
            return math.inf
        busy = {job.node for job in self.jobs.values()}
        keys = [self.selector.node_key(n) for n in self.roster(grid) if n not in busy]
        times = [t for t in (self.clock.next_online(k, self.clock.now) for k in keys) if t > self.clock.now]
        return min(times, default=math.inf)

    def idle(self, grid: Grid) -> None:
        """Nothing in flight and the round not over: no client was free and online. Move the
        virtual clock to the first moment one is online (real clock: wait a moment) and send."""
        if self.clock.virtual:
            keys = [self.selector.node_key(n) for n in self.roster(grid)]
            soonest = min((self.clock.next_online(k, self.clock.now) for k in keys), default=self.clock.now)
            self.clock.now = max(self.clock.now, soonest)
        elif STOP.wait(POLL_INTERVAL):
            raise_if_stopped()
        self.dispatch(grid)
        if not self.jobs and not self.wanted():
            raise RunFailed(f"{type(self).__name__}: no job in flight and no model to send (version {self.version})")

    # ================================================================== shared pieces
    def staleness(self, job: Job) -> int:
        """Aggregations since the job's model was sent."""
        return self.version - job.version

    def freeze(self) -> None:
        """The server's arrays are never written in place from here on (state_dict references)."""
        for model in [*(self.models or []), self.global_model or {}]:
            for value in model.values():
                value.setflags(write=False)

    def log_round(self, server_round: int, used: int, ended: int) -> None:
        log(INFO, "aggregate_train: round %d (version %d): %d of %d ended jobs used, %d failed, %d in flight, "
            "virtual time %.2fs", server_round, self.version, used, ended, len(self.failures), len(self.jobs), self.clock.now)

    # ================================================================== state
    def state_dict(self) -> dict[str, Any]:
        """The base state plus the jobs in flight (never a reply: they are sent again)."""
        return {**super().state_dict(), "async": {
            "version": self.version, "next_job": self.next_job, "draws": self.draws,
            "repeats": {k: list(v) for k, v in self.repeats.items()}, "sizes": dict(self.sizes),
            "jobs": [job.saved() for job in self.jobs.values()],
        }}

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        saved = state["async"]
        self.version, self.next_job, self.draws = int(saved["version"]), int(saved["next_job"]), int(saved["draws"])
        self.repeats = {k: list(v) for k, v in saved["repeats"].items()}
        self.sizes = dict(saved["sizes"])
        self.jobs = {int(j["id"]): Job(**j) for j in saved["jobs"]}
        self._by_message, self._encoded = {}, {}
