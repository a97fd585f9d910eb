"""Heterogeneous clients on a virtual clock: speed profiles, availability, deadlines.

A simulated client's job takes ``work × multiplier`` virtual seconds (docs/async.md):

- **work** is modelled from what the client trains on: its local batches
  (⌈num-examples / batch_size⌉ × local_epochs, or local_steps) × ``seconds_per_batch``
  (``work: measured`` takes the reply's own ``train_time`` instead, which depends on how busy the
  machine is);
- the **multiplier** is the client's speed, fixed for the run and drawn from the seed and the
  client's stable key (its partition id), so every method of a comparison meets the same slow
  clients: ``tiers`` (e.g. 20 % of the clients 10× slower; the tiers' shares are exact over the
  roster) or ``lognormal`` (exp(σ·z), median 1).

Optional **availability**: a share of the clients (exact over the roster) is offline for
``offline_share`` of every ``offline_period`` virtual seconds, each at its own phase. A job whose
client is offline when it starts, or goes offline before it finishes, is lost at that moment.

A synchronous round lasts as long as its slowest client, or, with a ``deadline``, at most the
deadline: a reply whose virtual duration exceeds it is rejected as a straggler's (the node named)
and the round goes on with the others (:meth:`VirtualClock.close_round`). The clock after every
round is ``virtual_time`` in ``metrics.jsonl``; the asynchronous strategies
(:mod:`strategies.asynchronous`) order their events by it.

With ``clock: real`` (a deployment) the clock is the wall clock of the server.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate
from fedmm.settings import Choice, Int, Nullable, Number, Rule, Settings, is_number, setting

PROFILES = ("none", "tiers", "lognormal")


class _Tiers(Rule):
    allowed = "a list of [fraction, multiplier] pairs, fractions in (0, 1] summing to at most 1, multipliers > 0"

    def ok(self, value: Any) -> bool:
        if not isinstance(value, (list, tuple)):
            return False
        for pair in value:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(is_number(v) for v in pair):
                return False
            if not 0 < pair[0] <= 1 or pair[1] <= 0:
                return False
        return sum(pair[0] for pair in value) <= 1 + 1e-9


@dataclass
class HeterogeneitySettings(Settings):
    """Heterogeneous clients on a virtual clock (docs/async.md): each client's job lasts its
    modelled work × its speed multiplier, in virtual seconds, so that time-to-accuracy does not
    depend on how busy the machine is. Off by default (every client at speed 1, no deadline)."""

    keyed = False
    profile: str = setting("none", Choice(*PROFILES), "speed multipliers: none (all 1) | tiers (the tiers' shares of "
                           "the clients are that many times slower) | lognormal (exp(sigma·z), median 1)",
                           label="{} speeds")
    tiers: list = setting([[0.2, 10.0]], _Tiers(), "profile tiers: [fraction, multiplier] pairs; the other clients run "
                          "at speed 1 (the shares are exact over the roster)")
    sigma: float = setting(1.0, Number(gt=0), "profile lognormal: sigma of log(multiplier)")
    seconds_per_batch: float = setting(0.05, Number(gt=0), "virtual seconds of one local batch at speed 1 "
                                       "(modelled work)")
    work: str = setting("modelled", Choice("modelled", "measured"), "modelled: local batches × seconds_per_batch | "
                        "measured: the reply's train_time (depends on the machine's load; synchronous methods only)")
    deadline: float | None = setting(None, Nullable(Number(gt=0), "null (wait for the slowest) or virtual seconds > 0"),
                                     "a job longer than this is a straggler's: its reply is rejected and the round goes "
                                     "on (asynchronous methods: the job ends at the deadline)", label="deadline {}")
    offline_fraction: float = setting(0.0, Number(ge=0, le=1), "share of the clients that go offline periodically "
                                      "(exact over the roster)", label="{} offline")
    offline_period: float = setting(600.0, Number(gt=0), "virtual seconds of one online/offline cycle")
    offline_share: float = setting(0.5, Number(ge=0, lt=1), "part of each cycle such a client is offline "
                                   "(its phase drawn from the seed and its key)")
    seed: int | None = setting(None, Nullable(Int(min=0), "null (the run's seed) or an integer >= 0"),
                               "seeds the multipliers and the availability (null: the run's seed)")
    clock: str = setting("virtual", Choice("virtual", "real"), "virtual: simulated durations (simulation) | real: "
                         "the server's wall clock (deployment; replies handled as they arrive)", label="{} clock")

    def check_values(self, prefix: str) -> None:
        """The real clock measures: nothing simulated goes with it."""
        if self.clock != "real":
            return
        for key, value, neutral in (("profile", self.profile, "none"), ("offline_fraction", self.offline_fraction, 0.0),
                                    ("deadline", self.deadline, None), ("work", self.work, "modelled")):
            if value != neutral:
                raise ConfigError(f"{prefix}{key}", value, f"{neutral if neutral is not None else 'null'} with "
                                  f"{prefix}clock=real (a deployment's clients are as fast and as available as they are)")


#: What a run made before heterogeneity was declared had: no effect on anything.
NEUTRAL = HeterogeneitySettings().to_dict()


@dataclass
class LocalWork:
    """What one local update costs in batches (the ``training`` group's values, as the
    clients use them)."""

    batch_size: int = 50
    local_epochs: int = 2
    local_steps: int | None = None
    drop_last: bool = False

    @classmethod
    def from_run(cls, run: Any) -> LocalWork:
        """The work of a run's clients: the training group with the objective's own overrides."""
        values = {**run.training.to_dict(), **(run.objective.get("training") or {})}
        return cls(int(values["batch_size"]), int(values["local_epochs"]), values.get("local_steps"),
                   bool(values.get("drop_last", False)))

    def batches(self, num_examples: float) -> int:
        """Local batches of a client with ``num_examples`` rows (as :func:`client_app.training.local_batches`)."""
        if self.local_steps is not None:
            return int(self.local_steps)
        n = int(num_examples)
        per_epoch = n // self.batch_size if self.drop_last and n >= self.batch_size else math.ceil(n / self.batch_size)
        return max(per_epoch, 0) * self.local_epochs


def unit(seed: int, key: str, stream: str) -> float:
    """A number in (0, 1) fixed by (seed, key, stream): the same on every run and machine."""
    digest = hashlib.sha256(f"{seed}\0{stream}\0{key}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") + 0.5) / 2.0**64


def exact_shares(keys: Sequence[str], fractions: Sequence[float], seed: int, stream: str) -> dict[str, int]:
    """Key -> the index of its share (or -1: none), with exactly round(cumulative fraction × N)
    keys up to each share: the keys ordered by :func:`unit`, cut at those counts."""
    ordered = sorted(keys, key=lambda k: (unit(seed, k, stream), k))
    out = {key: -1 for key in ordered}
    start, total = 0, 0.0
    for index, fraction in enumerate(fractions):
        total += fraction
        stop = min(len(ordered), math.floor(total * len(ordered) + 0.5))
        for key in ordered[start:stop]:
            out[key] = index
        start = max(start, stop)
    return out


def _share_of(u: float, fractions: Sequence[float]) -> int:
    """The share a key outside the roster falls in by its own unit number (expected shares)."""
    total = 0.0
    for index, fraction in enumerate(fractions):
        total += fraction
        if u < total:
            return index
    return -1


class VirtualClock:
    """The clock of a run and the clients' speeds and availability (:class:`HeterogeneitySettings`).

    ``now`` is the virtual time in seconds (the real clock's seconds with ``clock: real``); the
    roster (every client's stable key, set once) makes the tiers' and the offline clients' shares
    exact. Its state is ``now`` and the roster (:meth:`state_dict`).
    """

    def __init__(self, settings: HeterogeneitySettings | None = None, seed: int = 0, work: LocalWork | None = None) -> None:
        self.settings = settings if settings is not None else HeterogeneitySettings()
        self.seed = self.settings.seed if self.settings.seed is not None else seed
        self.work = work or LocalWork()
        self.now = 0.0
        self.roster: list[str] = []
        self._tier: dict[str, int] = {}
        self._offline: dict[str, int] = {}
        self._wall = time.monotonic()  # real clock: the monotonic time at which `now` was last set

    @property
    def virtual(self) -> bool:
        return self.settings.clock == "virtual"

    # ------------------------------------------------------------------ who is slow, who is away
    def set_roster(self, keys: Sequence[str]) -> None:
        """Fix the roster the exact shares are taken over (the first call only: a client that
        joins later gets its tier by its own draw, so nobody's tier changes mid-run)."""
        if self.roster or not keys:
            return
        self.roster = sorted(set(keys))
        self._assign()

    def _assign(self) -> None:
        s = self.settings
        self._tier = exact_shares(self.roster, [f for f, _ in s.tiers], self.seed, "tier") if s.profile == "tiers" else {}
        self._offline = exact_shares(self.roster, [s.offline_fraction], self.seed, "offline") if s.offline_fraction else {}

    def multiplier(self, key: str) -> float:
        """The client's speed multiplier (1: the reference speed; 10: ten times slower)."""
        s = self.settings
        if s.profile == "tiers":
            tier = self._tier[key] if key in self._tier else _share_of(unit(self.seed, key, "tier"), [f for f, _ in s.tiers])
            return float(s.tiers[tier][1]) if tier >= 0 else 1.0
        if s.profile == "lognormal":
            return math.exp(s.sigma * NormalDist().inv_cdf(unit(self.seed, key, "speed")))
        return 1.0

    def duration(self, key: str, num_examples: float | None, train_time: float | None = None) -> float | None:
        """Virtual seconds of one job of the client (None: not known, e.g. no size yet)."""
        if self.settings.work == "measured":
            return None if train_time is None else float(train_time) * self.multiplier(key)
        if num_examples is None:
            return None
        return self.work.batches(num_examples) * self.settings.seconds_per_batch * self.multiplier(key)

    def _cycling(self, key: str) -> bool:
        s = self.settings
        if not s.offline_fraction or not s.offline_share:
            return False
        if key in self._offline:
            return self._offline[key] == 0
        return unit(self.seed, key, "offline") < s.offline_fraction

    def _window(self, key: str, t: float) -> tuple[float, float]:
        """(start, end) of the offline window of the cycle that ``t`` is in."""
        s = self.settings
        phase = unit(self.seed, key, "phase") * s.offline_period
        cycle = math.floor((t + phase) / s.offline_period)
        start = cycle * s.offline_period - phase
        return start, start + s.offline_share * s.offline_period

    def online_until(self, key: str, t: float) -> float:
        """When the client is next offline from ``t`` on (``t`` itself when it is offline at
        ``t``; inf: never)."""
        if not self._cycling(key):
            return math.inf
        start, end = self._window(key, t)
        return t if start <= t < end else start + self.settings.offline_period

    def next_online(self, key: str, t: float) -> float:
        """The first moment from ``t`` on at which the client is online."""
        if not self._cycling(key):
            return t
        start, end = self._window(key, t)
        return end if start <= t < end else t

    def online(self, key: str, t: float) -> bool:
        return self.online_until(key, t) > t

    def cut(self, key: str, start: float, duration: float) -> tuple[float, str]:
        """When a job that starts at ``start`` and lasts ``duration`` ends, and why it is lost
        (``""``: it is not): its client is offline or goes offline first, or it runs past the
        deadline."""
        deadline = self.settings.deadline
        away = self.online_until(key, start)
        if away <= start:
            return start, f"offline at virtual time {start:.2f}s"
        limit = start + deadline if deadline is not None else math.inf
        if away < start + duration and away < limit:
            return away, f"went offline at virtual time {away:.2f}s, before finishing its {duration:.2f}s job"
        if deadline is not None and duration > deadline:
            return limit, f"straggler: virtual duration {duration:.2f}s exceeds the deadline ({deadline:g}s)"
        return start + duration, ""

    # ------------------------------------------------------------------ the clock
    def wall_now(self) -> float:
        """Real clock: advance ``now`` by the wall seconds since it was last read (or the
        clock was made, restored or :meth:`restart`-ed)."""
        moment = time.monotonic()
        self.now += moment - self._wall
        self._wall = moment
        return self.now

    def restart(self) -> None:
        """Real clock: count wall seconds from here on (the start of a run or of a resumed one)."""
        self._wall = time.monotonic()

    def close_round(
        self, nodes: Sequence[int], updates: list[ClientUpdate], selector: Any
    ) -> tuple[list[ClientUpdate], list[tuple[int, str]]]:
        """A synchronous round on the clock: ``nodes[slot]`` got the slot's model at ``now``.

        Returns the updates that count and ``(slot, reason)`` for the rejected ones (stragglers
        past the deadline, clients that were or went offline); ``now`` moves to the round's end:
        the slowest client's finish, or the moment the server learns a job is lost (the
        deadline; a client going offline). A client that sent nothing and whose size is not
        known adds the deadline where there is one, else nothing.
        """
        if not self.virtual:
            self.wall_now()
            return updates, []
        self.set_roster(selector.roster_keys())
        by_slot = {u.slot: u for u in updates}
        start = end = self.now
        kept: list[ClientUpdate] = []
        late: list[tuple[int, str]] = []
        for slot, node in enumerate(nodes):
            key = selector.node_key(node)
            update = by_slot.get(slot)
            size = update.num_examples if update is not None else selector.num_examples(node)
            took = self.duration(key, size, update.metrics.get("train_time") if update is not None else None)
            if took is None:
                if update is not None:
                    kept.append(update)
                elif self.settings.deadline is not None:
                    end = max(end, start + self.settings.deadline)
                continue
            finish, reason = self.cut(key, start, took)
            end = max(end, finish)
            if reason and update is not None:
                late.append((slot, reason))
            elif update is not None:
                kept.append(update)
        self.now = end
        return kept, late

    def state_dict(self) -> dict[str, Any]:
        return {"now": self.now, "roster": list(self.roster)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.now = float(state["now"])
        self.roster = []
        self.set_roster(list(state.get("roster", [])))
        self.restart()
