"""Asynchronous rounds: the driver that runs any method without a round barrier.

FedBuff is a one-model method on it; the asynchronous FedMR and FedCross are FedMR and FedCross
on it (the same arithmetic as their synchronous rounds, applied to the models that came back).

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

What a round is depends on what the method holds (:attr:`strategies.method.Method.holds`):
one model (:class:`OneModelJobs`, FedBuff): up to C clients train at once, each on the model
version it received, and B accepted updates end a round (B failed jobs in a row end one with no
aggregation); a model per node (:class:`PerNodeJobs`): each of the K models goes to the next free
client as soon as it is at the server, and B models back (trained or failed) end a round, whose
aggregation touches those B only. Either way the round ends as every round does
(:func:`strategies.rounds.end`): the defence stage on the round's updates, each against the model
version it was sent, then the method's aggregate.

Resume. :meth:`AsyncRound.state_dict` holds the jobs in flight (node key, model, version,
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
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from fedmm import protocol
from fedmm.errors import ConfigError
from fedmm.interrupt import STOP, raise_if_stopped
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Bool, Int, Nullable, Settings, setting
from strategies.contract import PER_NODE
from strategies.ledger import ReplyCheck, RunFailed
from strategies.messaging import POLL_INTERVAL
from strategies.rounds import begin, end

#: The run context (:class:`strategies.context.RunContext`): the driver runs any method's, and imports none.
RunContext = Any

#: rng stream of the dispatch draws after the first of a round (0: training, 1: evaluation).
ASYNC_STREAM = 2


@dataclass
class AsyncSettings(Settings):
    """``strategy.asynchronous``: the method's rounds without a barrier (docs/async.md); a method
    runs so only when it declares the asynchronous driver (:attr:`strategies.method.Method.drivers`)."""

    keyed = False
    #: Declared after runs were made: every value of a run made before (synchronous).
    added = {"enabled": False, "buffer_size": None, "max_staleness": None, "concurrency": None}
    enabled: bool = setting(False, Bool(), "no round barrier: the asynchronous driver sends each model to the next free "
                            "client and aggregates every B updates (FedBuff; FedMR and FedCross: every B models back)")
    buffer_size: int | None = setting(None, Nullable(Int(min=1), "null (half, rounded up) or an integer >= 1"),
                                      "B: the updates of an aggregation: accepted updates for a method with one model, "
                                      "models back (trained or failed) for one with a model per node (null: half of "
                                      "the concurrency, or of clients_per_round, rounded up)", label="B {}")
    max_staleness: int | None = setting(None, Nullable(Int(min=0), "null (no bound) or an integer >= 0"),
                                        "an update whose client trained on a copy more than this many aggregations old "
                                        "is dropped (one model), or its model restarts from the global model (a model "
                                        "per node); null: no bound", label="max staleness {}")
    concurrency: int | None = setting(None, Nullable(Int(min=1), "null (clients_per_round) or an integer >= 1"),
                                      "C: clients training at the same time, for a method with one model (null: "
                                      "clients_per_round; a method with a model per node has its K models in flight)",
                                      label="C {}")

    def check_values(self, prefix: str) -> None:
        """The driver's settings need the driver."""
        if self.enabled:
            return
        for name in ("buffer_size", "max_staleness", "concurrency"):
            if getattr(self, name) is not None:
                raise ConfigError(f"{prefix}{name}", getattr(self, name), f"null while {prefix}enabled is false (it is "
                                  "a setting of the asynchronous driver)")

    def buffer(self, holds: str, clients_per_round: int) -> int:
        """B: ``buffer_size``, else half the jobs in flight (the concurrency, or K), rounded up."""
        return self.buffer_size or half(clients_per_round if holds == PER_NODE else self.concurrency or clients_per_round)


def half(n: int) -> int:
    """⌈n / 2⌉, at least 1: B's default."""
    return max(1, math.ceil(n / 2))


def check_async(settings: Any, run: Any) -> None:
    """Rules of the asynchronous driver: uniform draws, modelled work on the virtual clock, B at
    most the K models of a method with a model per node (which has no concurrency), C at most N."""
    a, holds = settings.asynchronous, settings.strategy_class.holds
    if run.selection.name != "uniform":
        raise ConfigError("selection", run.selection.name, f"uniform with strategy={settings.option} and "
                          "strategy.asynchronous.enabled=true (each job's client is drawn among the free ones)")
    h = settings.heterogeneity
    if h.clock == "virtual" and h.work == "measured":
        raise ConfigError("strategy.heterogeneity.work", h.work, f"modelled with strategy={settings.option} on the "
                          "virtual clock (jobs are ordered by their durations before their replies are in)")
    if holds == PER_NODE and a.concurrency is not None:
        raise ConfigError("strategy.asynchronous.concurrency", a.concurrency, f"null with strategy={settings.option} (a "
                          "method with a model per node keeps its K models in flight, one per model)")
    if holds == PER_NODE and a.buffer_size is not None and a.buffer_size > run.clients_per_round:
        raise ConfigError("strategy.asynchronous.buffer_size", a.buffer_size, f"at most {run.clients_per_round} "
                          "(clients_per_round: the models of the run)")
    if a.concurrency is not None and a.concurrency > run.num_clients:
        raise ConfigError("strategy.asynchronous.concurrency", a.concurrency, f"at most num_clients ({run.num_clients})")


@dataclass
class Job:
    """One model sent to one client."""

    id: int
    node: int
    key: str
    model_index: int  # the model it carries (one-model methods: 0)
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


class OneModelJobs:
    """What jobs and rounds are for a method with one model (FedBuff): up to C jobs in flight
    (``concurrency``, default K), each with the model version current when it was sent; B
    accepted updates end a round (``buffer_size``, default ⌈C/2⌉), and so do B failed jobs in a
    row (no aggregation then); an update older than ``max_staleness`` versions is dropped."""

    def __init__(self, context: RunContext, loop: AsyncRound) -> None:
        self.context, self.loop, self.method = context, loop, context.method
        self.settings = self.method.settings.asynchronous
        #: The model versions that jobs in flight were sent (and the current one).
        self.versions: dict[int, ModelDict] = {}
        self.buffered: list[ClientUpdate] = []
        #: Jobs in a row that failed (B of them end a round with no aggregation: max_failed_rounds).
        self.failed_in_a_row = 0

    def limit(self) -> int:
        return self.settings.concurrency or self.method.clients_per_round

    def minimum_nodes(self) -> int:
        return self.limit()

    def buffer(self) -> int:
        return self.settings.buffer(self.method.holds, self.method.clients_per_round)

    def wanted(self) -> list[int]:
        return [0] * max(0, self.limit() - len(self.loop.jobs))

    def payload(self, job: Job) -> ModelDict:
        return self.versions.setdefault(job.version, self.method.models[0])

    def sent(self, job: Job) -> None:
        self.payload(job)

    def arrive(self, job: Job) -> bool:
        """Keep the update (or drop it); True when the round is over."""
        staleness = self.loop.staleness(job)
        limit = self.settings.max_staleness
        reason = job.failure
        if not reason and limit is not None and staleness > limit:
            reason = f"staleness {staleness} exceeds max_staleness ({limit}): update dropped"
            self.loop.failures.append(f"{self.loop.name(job)}: {reason}")
        if reason or job.update is None:
            self.failed_in_a_row += 1
            self.forget_versions()
            return self.failed_in_a_row >= self.buffer()
        self.failed_in_a_row = 0
        job.update.sent, job.update.staleness = self.versions[job.version], staleness
        self.buffered.append(job.update)
        self.forget_versions()
        return len(self.buffered) >= self.buffer()

    def forget_versions(self) -> None:
        """Keep only the versions a job in flight was sent, and the current one."""
        keep = {job.version for job in self.loop.jobs.values()} | {self.loop.version}
        self.versions = {v: m for v, m in self.versions.items() if v in keep}

    def close(self, server_round: int) -> tuple[ArrayRecord | None, MetricRecord, bool]:
        """The round's end over the buffered updates (none when it ended on failures):
        (arrays, metrics, whether an aggregation was made)."""
        updates = self.buffered
        if len(updates) < self.buffer():  # B failed jobs in a row: no step this round
            self.context.last_round.replies, self.context.last_round.rejections = 0, list(self.loop.failures)
            self.loop.log_round(server_round, 0, self.failed_in_a_row)
            self.failed_in_a_row = 0
            return None, MetricRecord({"replies": 0.0}), False
        self.buffered = []
        self.loop.log_staleness([u.staleness for u in updates])
        arrays, metrics = end(self.context, self.loop.version + 1, updates, self.loop.failures)
        self.versions[self.loop.version + 1] = self.method.models[0]
        self.loop.log_round(server_round, self.context.last_round.replies, len(updates) + len(self.loop.failures))
        return arrays, metrics, True

    def state_dict(self) -> dict[str, Any]:
        """The versions in flight (the buffer is empty between rounds)."""
        return {"fedbuff": {"versions": dict(self.versions), "failed_in_a_row": self.failed_in_a_row}}

    def load_state_dict(self, state: Any) -> None:
        saved = state["fedbuff"]
        self.versions = {int(v): m for v, m in saved["versions"].items()}
        self.failed_in_a_row = int(saved["failed_in_a_row"])


class PerNodeJobs:
    """What jobs and rounds are for a method with a model per node (asynchronous FedMR, FedCross):
    each of the K models goes to the next free client as soon as it is at the server; B models
    back (trained, failed, or too stale: ``max_staleness``, the model restarts from the global
    model) end a round, whose operation acts among those B (``buffer_size``, default ⌈K/2⌉)."""

    def __init__(self, context: RunContext, loop: AsyncRound) -> None:
        self.context, self.loop, self.method = context, loop, context.method
        self.settings = self.method.settings.asynchronous
        #: Models at the server waiting for a free client, in the order they go out.
        self.ready: list[int] = list(range(self.method.clients_per_round))
        #: Models back since the last aggregation: index -> the accepted update (None: failed, or too stale).
        self.arrived: dict[int, ClientUpdate | None] = {}

    def minimum_nodes(self) -> int:
        return self.method.clients_per_round

    def buffer(self) -> int:
        return self.settings.buffer(self.method.holds, self.method.clients_per_round)

    def wanted(self) -> list[int]:
        return list(self.ready)

    def payload(self, job: Job) -> ModelDict:
        return self.method.models[job.model_index]

    def sent(self, job: Job) -> None:
        self.ready.remove(job.model_index)

    def arrive(self, job: Job) -> bool:
        """The model is back: trained, or as it was sent (failed), or restarted (too stale)."""
        s = self.method
        staleness, limit = self.loop.staleness(job), self.settings.max_staleness
        update = None if job.failure else job.update
        if update is not None and limit is not None and staleness > limit:
            self.loop.failures.append(f"{self.loop.name(job)}: staleness {staleness} exceeds max_staleness "
                                      f"({limit}): the model restarts from the global model")
            s.models[job.model_index] = s.global_model
            update = None
        if update is not None:  # the model it was sent is still the model of its index (none is changed in flight)
            update.sent, update.staleness = s.models[job.model_index], staleness
        self.arrived[job.model_index] = update
        return len(self.arrived) >= self.buffer()

    def close(self, server_round: int) -> tuple[ArrayRecord | None, MetricRecord, bool]:
        """The round's end among the B models back (the K-model mean is the global model)."""
        indices = sorted(self.arrived)
        updates = [u for u in (self.arrived[i] for i in indices) if u is not None]
        self.loop.log_staleness([u.staleness for u in updates])
        before = len(self.loop.failures)
        arrays, metrics = end(self.context, self.loop.version + 1, updates, self.loop.failures, members=indices)
        for reason in self.loop.failures[before:]:
            log(WARNING, "\t> rejected: %s", reason)
        self.arrived = {}
        self.ready = sorted(self.ready + indices)
        self.loop.log_round(server_round, self.context.last_round.replies, len(indices))
        return arrays, metrics, True

    def state_dict(self) -> dict[str, Any]:
        """The models waiting for a client (none are back at a round's end)."""
        return {"multimodel": {"ready": list(self.ready), "arrived": {}}}

    def load_state_dict(self, state: Any) -> None:
        self.ready = [int(i) for i in state["multimodel"]["ready"]]
        self.arrived = {}


class AsyncRound:
    """The asynchronous driver (module docstring): jobs, dispatch, order, faults and resume; what
    a job carries and what ends a round is its policy's (:class:`OneModelJobs` or :class:`PerNodeJobs`)."""

    def __init__(self, context: RunContext) -> None:
        self.context = context
        self.policy = (PerNodeJobs if context.method.holds == PER_NODE else OneModelJobs)(context, self)
        #: Aggregations so far (the version of the server's models).
        self.version = 0
        #: The jobs in flight.
        self.flight = Flight(self)
        #: Jobs that failed this round (reasons), for the log and ``max_failed_rounds``.
        self.failures: list[str] = []
        self.num_rounds: int | None = None

    @property
    def jobs(self) -> dict[int, Job]:
        """The jobs in flight, by number."""
        return self.flight.jobs

    # ================================================================== the driver
    def configure(self, *args: Any) -> list[Message]:
        raise NotImplementedError(f"{type(self.context.method).__name__} runs its own asynchronous loop: call its start() "
                                  "(Flower's configure_train / aggregate_train drive synchronous rounds)")

    aggregate = configure

    def start(self, num_rounds: int) -> None:
        """No job is sent after the last aggregation; the clock starts."""
        self.num_rounds = num_rounds
        self.context.clock.restart()

    def run(self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord,
            timeout: float) -> tuple[ArrayRecord | None, MetricRecord]:
        """Handle ended jobs, sending new ones, until the next aggregation (one "round")."""
        s = self.context
        begin(s, arrays)
        flight = self.flight
        self.failures, flight.train_config = [], config
        with s.observers.phase(server_round, "exchange"):
            flight.resend(grid)
            flight.dispatch(grid)
            while True:
                job = flight.next_ended(grid, timeout)
                del flight.jobs[job.id]
                if job.failure:
                    self.failures.append(f"{self.name(job)}: {job.failure}")
                    log(WARNING, "\t> job failed: %s", self.failures[-1])
                elif job.update is not None:
                    flight.sizes[job.key] = job.update.num_examples
                if self.policy.arrive(job):
                    break
                flight.dispatch(grid)
        s.method.round_log.update({"virtual_time": s.clock.now, "in_flight": float(len(self.jobs))})
        with s.observers.phase(server_round, "aggregate"):
            arrays, metrics, aggregated = self.policy.close(server_round)
        if aggregated:  # a new version: its draws start at stream 0 again
            self.version += 1
            flight.draws = 0
        flight.forget_encoded(self.version)
        if self.num_rounds is None or server_round < self.num_rounds:
            flight.dispatch(grid)
        return arrays, metrics

    def describe(self) -> str:
        return (f"Asynchronous: B={self.policy.buffer()} per aggregation, at most {self.policy.minimum_nodes()} jobs in "
                f"flight, {self.context.clock.settings.clock} clock")

    def staleness(self, job: Job) -> int:
        """Aggregations since the job's model was sent."""
        return self.version - job.version

    def name(self, job: Job) -> str:
        several = len(self.context.method.models or []) > 1
        return f"node {job.node} (job {job.id}" + (f", model {job.model_index})" if several else ")")

    def log_staleness(self, staleness: list[int]) -> None:
        if staleness:
            self.context.method.round_log.update({"staleness_mean": sum(staleness) / len(staleness),
                                            "staleness_max": float(max(staleness))})

    def log_round(self, server_round: int, used: int, ended: int) -> None:
        log(INFO, "aggregate_train: round %d (version %d): %d of %d ended jobs used, %d failed, %d in flight, "
            "virtual time %.2fs", server_round, self.version + 1, used, ended, len(self.failures), len(self.jobs),
            self.context.clock.now)

    # ================================================================== state
    def state_dict(self) -> dict[str, Any]:
        """The jobs in flight (never a reply: they are sent again) and the policy's state."""
        f = self.flight
        return {"async": {"version": self.version, "next_job": f.next_job, "draws": f.draws,
                          "repeats": {k: list(v) for k, v in f.repeats.items()}, "sizes": dict(f.sizes),
                          "jobs": [job.saved() for job in f.jobs.values()]}, **self.policy.state_dict()}

    def load_state_dict(self, state: Any) -> None:
        saved = state["async"]
        self.version = int(saved["version"])
        self.flight = f = Flight(self)
        f.next_job, f.draws = int(saved["next_job"]), int(saved["draws"])
        f.repeats = {k: list(v) for k, v in saved["repeats"].items()}
        f.sizes = dict(saved["sizes"])
        f.jobs = {int(j["id"]): Job(**j) for j in saved["jobs"]}
        self.policy.load_state_dict(state)


class Flight:
    """The jobs in flight of an asynchronous run (:class:`AsyncRound`): who gets which model, when
    each ends (module docstring: "Order", "Dispatch"), their messages and replies."""

    def __init__(self, loop: AsyncRound) -> None:
        self.loop = loop
        #: Jobs in flight, by number.
        self.jobs: dict[int, Job] = {}
        self.next_job = 1
        #: Dispatch draws since the last aggregation (the rng stream of the next one).
        self.draws = 0
        #: node key -> [server-round, jobs sent with it] (the ``round-repeat`` of its next job).
        self.repeats: dict[str, list[int]] = {}
        #: node key -> num-examples of its last valid reply (its size when the roster gives none).
        self.sizes: dict[str, float] = {}
        self.train_config: ConfigRecord = ConfigRecord()
        self._by_message: dict[str, int] = {}
        self._encoded: dict[tuple[int, int], ArrayRecord] = {}

    def roster(self, grid: Grid) -> list[int]:
        """The connected nodes ordered by their stable keys (as the selector orders them)."""
        return list(self.loop.context.selector.ordered_nodes(grid, self.loop.policy.minimum_nodes()))

    def dispatch(self, grid: Grid) -> None:
        """Send the wanted models to free clients, drawn at random (module docstring)."""
        s = self.loop.context
        wanted = self.loop.policy.wanted()
        if not wanted:
            return
        nodes = self.roster(grid)
        s.clock.set_roster([s.selector.node_key(n) for n in nodes])
        now = s.clock.now if s.clock.virtual else s.clock.wall_now()
        busy = {job.node for job in self.jobs.values()}
        free = [n for n in nodes if n not in busy and s.clock.online(s.selector.node_key(n), now)]
        count = min(len(wanted), len(free))
        if count == 0:
            return
        rng = np.random.default_rng([s.method.seed, self.loop.version + 1] + ([ASYNC_STREAM, self.draws] if self.draws else []))
        self.draws += 1
        picked = [free[i] for i in rng.choice(len(free), size=count, replace=False)]
        jobs = [self._new_job(index, node, now) for index, node in zip(wanted, picked)]
        self._push(grid, [job for job in jobs if not job.lost])

    def _new_job(self, model_index: int, node: int, now: float) -> Job:
        s = self.loop.context
        key = s.selector.node_key(node)
        server_round = self.loop.version + 1
        last = self.repeats.get(key)
        repeat = last[1] if last and last[0] == server_round else 0
        self.repeats[key] = [server_round, repeat + 1]
        job = Job(self.next_job, node, key, model_index, self.loop.version, server_round, repeat, now)
        self.next_job += 1
        if s.clock.virtual:
            size = s.selector.num_examples(node)
            self._time(job, s.clock.duration(key, size if size is not None else self.sizes.get(key)))
        self.jobs[job.id] = job
        self.loop.policy.sent(job)
        return job

    def _time(self, job: Job, duration: float | None) -> None:
        """Give ``job`` its duration, hence its finish time (or the moment it is lost)."""
        if duration is None:
            return
        job.duration = duration
        job.finish, job.lost = self.loop.context.clock.cut(job.key, job.start, duration)

    def _message(self, job: Job) -> Message:
        s = self.loop.context
        cache = (job.version, job.model_index)
        if cache not in self._encoded:
            self._encoded[cache] = protocol.model_to_record(self.loop.policy.payload(job))
        config = {**dict(self.train_config), protocol.SERVER_ROUND: job.server_round, protocol.MODEL_INDEX: job.model_index,
                  protocol.ACCEPTED_ROUND: s.replies.accepted_rounds.get(job.node, 0), **s.train_config(job.server_round)}
        if job.repeat:
            config[protocol.ROUND_REPEAT] = job.repeat
        return protocol.server_message(protocol.TRAIN, job.node, config, self._encoded[cache],
                                       s.method.extra_records(job.server_round, job.model_index),
                                       arrays_key=s.conventions.arrayrecord_key, config_key=s.conventions.configrecord_key)

    def forget_encoded(self, version: int) -> None:
        """Only the messages' models of the current version stay encoded."""
        self._encoded = {k: v for k, v in self._encoded.items() if k[0] == version}

    def _push(self, grid: Grid, jobs: list[Job]) -> None:
        if not jobs:
            return
        messages = [self._message(job) for job in jobs]
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
        nodes = {self.loop.context.selector.node_key(n): n for n in self.roster(grid)}
        for job in restored:
            if job.key in nodes:
                job.node = nodes[job.key]
            else:
                job.replied, job.reason = True, "its node is not connected after the resume"
        self._push(grid, [job for job in restored if not job.replied])

    def _receive(self, job: Job, reply: Message) -> None:
        """Decode and check a reply as the synchronous round does (:class:`~strategies.ledger.ReplyCheck`)."""
        s = self.loop.context
        update, reason = ReplyCheck.of(s, job.server_round).check(reply, job.model_index, job.node)
        job.update, job.reason, job.replied, job.arrived_at = update, reason, True, time.monotonic()
        if s.clock.virtual and job.duration is None:
            self._time(job, s.clock.duration(job.key, update.num_examples if update is not None else None))

    def _pull(self, grid: Grid) -> None:
        waiting = [job.message_id for job in self.jobs.values() if job.message_id and not job.replied]
        if not waiting:
            return
        replies = list(grid.pull_messages(waiting))
        while replies:
            reply = replies.pop(0)
            job = self.jobs.get(self._by_message.pop(reply.metadata.reply_to_message_id, -1))
            if job is not None and not job.replied:
                self._receive(job, reply)
            del reply

    def next_ended(self, grid: Grid, timeout: float) -> Job:
        """The next job to handle (module docstring, "Order"), waiting for it as long as needed."""
        clock = self.loop.context.clock
        while True:
            raise_if_stopped()
            self._pull(grid)
            moment = time.monotonic()
            for job in self.jobs.values():
                if job.message_id and not job.replied and moment - job.pushed_at >= timeout:
                    job.replied, job.reason, job.arrived_at = True, f"no reply within {timeout:g}s", moment
            job = self._due()
            if job is not None and clock.virtual:
                ends = job.finish if job.finish is not None else clock.now
                wake = self._wake(grid)
                if wake < ends:  # a free client comes online first: it gets a job then
                    clock.now = wake
                    self.dispatch(grid)
                    continue
                clock.now = max(clock.now, ends)
            if job is not None:
                return job
            if not self.jobs:
                self._idle(grid)
                continue
            if STOP.wait(POLL_INTERVAL):
                raise_if_stopped()

    def _due(self) -> Job | None:
        """The job whose end comes next, if it can be handled now."""
        clock = self.loop.context.clock
        jobs = list(self.jobs.values())
        if not jobs:
            return None
        if not clock.virtual:  # arrival order
            ended = [job for job in jobs if job.replied]
            if not ended:
                return None
            clock.wall_now()
            return min(ended, key=lambda job: (job.arrived_at, job.id))
        if any(job.finish is None and not job.replied for job in jobs):
            return None  # a job's duration is not known yet: it may end first
        first = min(jobs, key=lambda job: (job.finish if job.finish is not None else clock.now, job.id))
        return first if first.replied or first.lost else None

    def _wake(self, grid: Grid) -> float:
        """Virtual clock with availability: when the first free offline client comes online,
        if a model waits for one (inf otherwise)."""
        s = self.loop.context
        if not s.clock.settings.offline_fraction or not self.loop.policy.wanted():
            return math.inf
        busy = {job.node for job in self.jobs.values()}
        keys = [s.selector.node_key(n) for n in self.roster(grid) if n not in busy]
        times = [t for t in (s.clock.next_online(k, s.clock.now) for k in keys) if t > s.clock.now]
        return min(times, default=math.inf)

    def _idle(self, grid: Grid) -> None:
        """Nothing in flight and the round not over: no client was free and online. Move the
        virtual clock to the first moment one is online (real clock: wait a moment) and send."""
        s = self.loop.context
        if s.clock.virtual:
            keys = [s.selector.node_key(n) for n in self.roster(grid)]
            soonest = min((s.clock.next_online(k, s.clock.now) for k in keys), default=s.clock.now)
            s.clock.now = max(s.clock.now, soonest)
        elif STOP.wait(POLL_INTERVAL):
            raise_if_stopped()
        self.dispatch(grid)
        if not self.jobs and not self.loop.policy.wanted():
            raise RunFailed(f"{type(s.method).__name__}: no job in flight and no model to send (version {self.loop.version})")
