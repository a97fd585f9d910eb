"""The round loop every method runs on: a Flower ``Strategy`` that owns ``start``.

:class:`RoundLoopStrategy` keeps the server's models (one for FedAvg, K for FedMR / FedCross),
selects the round's nodes with a pluggable :class:`~strategies.selection.ClientSelector`, sends
each selected node the model of its slot in its own message, decodes and validates every reply
(:func:`fedmm.protocol.decode_train_reply`), hands each accepted update to the method
(:meth:`~RoundLoopStrategy.on_update`), then lets the method aggregate
(:meth:`~RoundLoopStrategy.aggregate`). Compared with Flower's own ``Strategy.start`` it can

- start at any round from a checkpoint (``start(..., start_round=r)`` after
  :meth:`~RoundLoopStrategy.load_state_dict`);
- run several ``send_and_receive`` phases inside one round (override
  :meth:`~RoundLoopStrategy.run_round` and call :meth:`~RoundLoopStrategy.send` per phase);
- call back after every round (``round_end``), where the runner writes checkpoints.

A method reads as its difference: override :meth:`aggregate` (and, if it needs them,
:meth:`extra_records`, :meth:`reply_extras`, :meth:`on_update`, :meth:`run_round`,
:meth:`state_dict`). Nodes that fail, time out or send a reply that fails validation lose
nothing: the model they were given stays where it was.
"""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from fedmm import protocol
from fedmm.interrupt import STOP, raise_if_stopped
from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Choice, Int, Nullable, Number, Settings, setting
from strategies.aggregation import robust_mean_models
from strategies.defence import Defence, DefenceSettings, refuse
from strategies.heterogeneity import NEUTRAL, HeterogeneitySettings, VirtualClock
from strategies.selection import ClientSelector, SeededRosterSelector

#: Seconds between two pulls while replies are outstanding (a reply waits at most this long
#: in the SuperLink before the server sees it).
POLL_INTERVAL = 0.01

def non_finite_key(model: ModelDict | None) -> str | None:
    """The first key of ``model`` holding NaN or Inf, or None."""
    for key, value in (model or {}).items():
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            return key
    return None


def exchange(
    grid: Grid,
    messages: list[Message],
    timeout: float | None,
    on_reply: Callable[[Message], None] | None = None,
    poll_interval: float = POLL_INTERVAL,
) -> list[Message]:
    """Push ``messages`` and pull their replies until all are in, ``timeout`` seconds pass
    (None: no limit) or a stop is requested (:mod:`fedmm.interrupt`).

    The list is emptied once pushed, so that only the grid holds the messages until their
    replies are in. With ``on_reply`` each reply is handed to it as soon as it is pulled and not
    kept (an empty list is returned); without, the replies are returned. A pull that brought
    replies is followed by the next at once (more may be in); one that brought none by a wait of
    ``poll_interval``.
    """
    raise_if_stopped()
    pending = set(grid.push_messages(messages))
    messages.clear()
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    replies: list[Message] = []
    while pending:
        pulled = list(grid.pull_messages(pending))
        got = bool(pulled)
        while pulled:
            reply = pulled.pop(0)  # the pulled list does not keep a handled reply alive
            pending.discard(reply.metadata.reply_to_message_id)
            if on_reply is None:
                replies.append(reply)
            else:
                on_reply(reply)
            del reply  # nor does this frame while the next one is pulled
        if not pending or time.monotonic() >= deadline:
            break
        if got:
            raise_if_stopped()
        elif STOP.wait(poll_interval):
            raise_if_stopped()
    return replies


@dataclass
class StrategySettings(Settings):
    """Settings every server method has; a method's own declaration extends this one.

    Class attributes: ``companions`` (config groups the method selects, e.g. the client
    objective its clients need: ``{"objective": "scaffold"}``), ``weighs_replies`` (True for
    one-model methods whose mean a selector may weigh: clustered sampling).
    """

    group = "strategy"
    companions: ClassVar[dict[str, str]] = {}
    weighs_replies: ClassVar[bool] = False
    #: Defence settings that have no meaning for the method: {setting: why} (refused when set).
    refused_defences: ClassVar[dict[str, str]] = {}
    fraction_evaluate: float = setting(0.0, Number(ge=0.0, le=1.0),
                                       "share of the connected nodes that evaluate the global model each round")
    max_num_examples: int | None = setting(None, Nullable(Int(min=1), "null (2**31 - 1) or an integer >= 1"),
                                           "the largest num-examples a train reply may report for a node whose size "
                                           "the roster did not report (a reply above the node's roster size is always "
                                           "rejected): bounds one client's share of an example-weighted mean")

    defence: DefenceSettings = setting(DefenceSettings(), help="optional defences against hostile updates "
                                       "(docs/reliability.md)")
    heterogeneity: HeterogeneitySettings = setting(HeterogeneitySettings(), help="client speeds, availability and "
                                                   "deadlines on a virtual clock (docs/async.md)")

    #: Declared after runs were made: the values that reproduce those runs.
    added = {"max_num_examples": None, "defence": {"clip_update_norm": None, "robust_mean": "none", "trim_fraction": 0.1},
             "heterogeneity": NEUTRAL}

    def check_values(self, prefix: str) -> None:
        """A defence the method declares meaningless for it is refused."""
        refuse(self.defence, self.refused_defences, self.option or type(self).__name__)

    def check(self, run: Any) -> None:
        """Clients evaluate on rows they never train on: fraction_evaluate > 0 needs a held-out part."""
        held_out = getattr(run.partition, "local_test_fraction", 0.0)
        if self.fraction_evaluate > 0 and not held_out:
            raise ConfigError(
                "partition.local_test_fraction",
                held_out,
                f"a fraction > 0 when strategy.fraction_evaluate={self.fraction_evaluate} "
                "(clients evaluate on held-out rows of their own data, never on what they train on)",
            )


class WrapperRefused(RuntimeError):
    """A strategy of this package was wrapped by a strategy that runs Flower's loop around it."""


def refuse_wrapper(strategy: Strategy, caller: Any) -> None:
    """Raise :class:`WrapperRefused` when ``caller`` (whoever asked ``strategy`` for its summary,
    as a strategy's ``start`` does) is another Flower strategy: a wrapper drives
    ``configure_train`` / ``aggregate_train`` from Flower's loop, which none of these methods
    can be run by correctly, and Flower's DP wrappers would be silently wrong."""
    if not isinstance(caller, Strategy) or caller is strategy:
        return
    name, wrapper = type(strategy).__name__, type(caller).__name__
    dp = "DifferentialPrivacy" in wrapper
    raise WrapperRefused(
        f"{name} cannot run inside {wrapper}: "
        + (f"the wrapper clips each reply against the one ArrayRecord it hands {name} (not the model that node was "
           f"sent: {name} keeps its own models, one per node for the multi-model methods) and adds its noise to the "
           f"arrays {name} returns, while the models {name} sends next round are its own and never noised, so the "
           "privacy guarantee it reports would not hold. " if dp else
           f"the wrapper runs Flower's round loop, which skips {name}'s own (checkpoints, multi-phase rounds, its "
           "models). ")
        + f"Run {name} unwrapped ({name}.start), bounding each update against the model its node was sent with "
        "strategy.defence.clip_update_norm or adaptive_clip (no noise: no differential-privacy guarantee); "
        + ("for differentially private training use Flower's own FedAvg inside the wrapper." if dp else "")
    )


class RunFailed(RuntimeError):
    """The run cannot go on (e.g. no client reply was accepted for ``max_failed_rounds`` rounds)."""


#: Called after every round with (round, global arrays, result so far).
RoundEnd = Callable[[int, ArrayRecord, Result], None]

#: Flower's metric aggregation function: (the replies' RecordDicts, the weighting key) -> MetricRecord.
MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]


@dataclass
class MultiModelResult(Result):
    """Flower's :class:`~flwr.serverapp.strategy.Result` plus the server's models.

    ``arrays`` stays the global model (for the multi-model methods the mean of the K models);
    ``models`` holds the models the server kept after the last round (K for FedMR / FedCross,
    one for FedAvg), in model-index order; ``evaluate_metrics_models[round]`` holds the
    ``evaluate_fn`` result of each of them, when the strategy was made with
    ``evaluate_models=True``.
    """

    models: list[ArrayRecord] = field(default_factory=list)
    evaluate_metrics_models: dict[int, list[MetricRecord]] = field(default_factory=dict)

    def __repr__(self) -> str:
        rep = super().__repr__()
        if self.models:
            size = sum(len(a.data) for a in self.models[0].values()) / (1024**2)
            rep += f"\nServer models:\n\t{len(self.models)} ArrayRecord(s) ({size:.3f} MB each)\n"
        if self.evaluate_metrics_models:
            rep += "\nServerApp-side Evaluate Metrics of each model:\n"
            for server_round, records in sorted(self.evaluate_metrics_models.items()):
                rep += f"\t{server_round}: " + "; ".join(_metrics_text(r) for r in records) + "\n"
        return rep


def _metrics_text(record: Mapping[str, Any] | None) -> str:
    """A metric record as one short line (4 significant digits)."""
    if record is None:
        return "None"
    return "{" + ", ".join(f"'{k}': {v:.4g}" if isinstance(v, float) else f"'{k}': {v}" for k, v in record.items()) + "}"


def default_metrics_aggregation(records: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """Flower's default: the mean of every numeric metric the replies share, weighted by
    ``weighted_by_key`` (summed into the record, as the round's total)."""
    return MetricRecord(protocol.weighted_metrics(
        [{k: float(v) for r in rd.metric_records.values() for k, v in r.items() if isinstance(v, (int, float))}
         for rd in records], weighted_by_key))


#: Keyword arguments every strategy takes besides its settings: Flower's record conventions
#: (the keys a ClientApp reads and writes) and per-model evaluation.
INTERFACE_DEFAULTS: dict[str, Any] = {
    "weighted_by_key": protocol.NUM_EXAMPLES,
    "arrayrecord_key": protocol.ARRAYS,
    "configrecord_key": protocol.CONFIG,
    "train_metrics_aggr_fn": None,
    "evaluate_metrics_aggr_fn": None,
    "evaluate_models": False,
}


class RoundLoopStrategy(Strategy):
    """Base of every method: selection, per-node dispatch, reply checks, the round loop, state.

    A method declares its settings once, as a :class:`StrategySettings` subclass named by the
    class attribute ``Settings``; the strategy holds them in ``self.settings`` and reads them as
    attributes too (``self.alpha`` is ``self.settings.alpha``).

    Parameters
    ----------
    clients_per_round : int
        K: nodes selected per round (and models kept, for multi-model methods).
    seed : int
        Seeds the default selector and the method's own randomness (``self.rng``).
    fraction_evaluate : float, optional
        Share of the connected nodes that evaluate the global model each round (a setting).
    selector : ClientSelector, optional
        Which nodes take part; default: :class:`SeededRosterSelector` with ``seed``, without the
        roster query (nodes ordered by node id).
    settings : StrategySettings, optional
        The method's settings (default: the declared defaults).
    weighted_by_key, arrayrecord_key, configrecord_key : str, optional
        As in Flower's strategies: the reply metric that weighs a client ("num-examples"), the
        record names of the model ("arrays") and of the config ("config") in the messages.
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable, optional
        As in Flower's strategies: ``(list[RecordDict], weighted_by_key) -> MetricRecord`` over the
        accepted replies (default: the example-weighted mean, :func:`default_metrics_aggregation`).
    evaluate_models : bool, optional
        Also evaluate each of the server's models with ``evaluate_fn`` after every round (the K
        models of FedMR / FedCross): logged, and in :attr:`MultiModelResult.evaluate_metrics_models`.
    **changes
        Settings to change from ``settings`` (validated): ``FedMR(4, 0, first_stage_rounds=5)``.
    """

    #: The method's settings declaration.
    Settings: ClassVar[type[StrategySettings]] = StrategySettings

    #: True when the method writes into the arrays of the updates it gets (e.g. FedCross fuses
    #: in place): replies are then decoded into new writable arrays. False: read-only views of
    #: the reply's bytes, no copy.
    writable_updates = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Settings" in cls.__dict__:  # the declaration knows what it builds
            cls.Settings.strategy_class = cls

    def __init__(
        self,
        clients_per_round: int,
        seed: int,
        fraction_evaluate: float | None = None,
        selector: ClientSelector | None = None,
        *,
        settings: StrategySettings | None = None,
        **changes: Any,
    ) -> None:
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        if fraction_evaluate is not None:
            changes["fraction_evaluate"] = fraction_evaluate
        for name, default in INTERFACE_DEFAULTS.items():  # Flower's conventions, not settings
            setattr(self, name, changes.pop(name, default))
        for name in ("weighted_by_key", "arrayrecord_key", "configrecord_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        settings = settings if settings is not None else self.Settings()
        if not isinstance(settings, self.Settings):
            raise TypeError(f"{type(self).__name__} takes {self.Settings.__name__}, got {type(settings).__name__}")
        self.settings = settings.replace(**changes) if changes else settings
        self.clients_per_round = clients_per_round
        self.seed = seed
        # A strategy made in any Flower app sends no roster query (its ClientApp may have no
        # query handler); the fedmm app turns the query on (strategies.build_strategy).
        self.selector = selector or SeededRosterSelector(seed, query=False)
        self.rng = np.random.default_rng([seed, 0x5EED])
        #: Virtual time and the clients' speeds (strategies/heterogeneity.py); `build_strategy` sets its work model.
        self.clock = VirtualClock(getattr(self.settings, "heterogeneity", None), seed)
        #: The server's models (FedAvg: one; multi-model methods: K).
        self.models: list[ModelDict] | None = None
        #: The model evaluated and saved as the run's result.
        self.global_model: ModelDict | None = None
        self.spec: protocol.ArraySpec | None = None
        self.last_replies = 0
        self.last_rejections: list[str] = []
        #: Federated-evaluation metrics of the current round (None when clients did not evaluate).
        self.last_evaluate_metrics: dict[str, float] | None = None
        #: Numbers a method reports about its own round (e.g. FedExP's server step size), written
        #: into the round's row of ``metrics.jsonl``; reset at the start of every round.
        self.round_log: dict[str, float] = {}
        #: node id -> the last round whose train reply of that node was accepted (sent to the
        #: node with its next train message: its objective keeps state made in a rejected round
        #: out, :meth:`objectives.base.LocalUpdate.keep`).
        self.accepted_rounds: dict[int, int] = {}
        # Metadata of the round's train messages (the grid fills in their ids when it pushes
        # them); the messages themselves are not kept once pushed.
        self._pending: list[Any] = []
        self._slot_of: dict[str, int] | None = None
        self._round_updates: list[ClientUpdate] = []
        self._round_seen: set[int] = set()
        self._round_rejected: list[str] = []
        self._round_extras: dict[str, protocol.ArraySpec] = {}

    @classmethod
    def from_settings(cls, run: Any) -> RoundLoopStrategy:
        """The strategy of a run's settings (:class:`fedmm.config.RunSettings`): K from
        ``clients_per_round``, the seed, the method's settings."""
        return cls(run.clients_per_round, run.seed, settings=run.strategy)

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__.get("settings")
        if settings is not None and name in type(settings).__dataclass_fields__:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ================================================================== method hooks
    def initialize(self, initial: ModelDict) -> None:
        """Set the models from the initial model (default: one model)."""
        self.models = [initial]

    def model_for_slot(self, slot: int) -> int:
        """Index of the server model sent to the ``slot``-th selected node (default: model 0)."""
        return 0

    def prepare_round(self, server_round: int, node_ids: list[int]) -> None:
        """Called with the round's selected nodes (in slot order) before their messages are
        built (e.g. to put each node's own model in its slot). Default: nothing."""

    def models_to_evaluate(self) -> list[ModelDict] | None:
        """Several models for the central evaluation to report on (mean and spread of their
        accuracy), or None: the global model is evaluated (default)."""
        return None

    def models_to_track(self) -> list[ModelDict] | None:
        """Models whose own accuracy the central evaluation records beside the global model's
        (``model_<i>_accuracy``), or None (default)."""
        return None

    def extra_records(self, server_round: int, slot: int) -> dict[str, Any]:
        """Further records of the train message of ``slot`` (e.g. a control variate)."""
        return {}

    def reply_extras(self, server_round: int) -> dict[str, protocol.ArraySpec]:
        """ArrayRecords, by name, that every train reply must carry besides ``arrays``."""
        return {}

    def on_update(self, server_round: int, update: ClientUpdate) -> None:
        """Called with each accepted client update, before :meth:`aggregate`."""

    def update_weights(self, updates: list[ClientUpdate]) -> list[float]:
        """Weights of the updates in a one-model mean: the selector's where it decides them
        (clustered sampling), else ``num-examples`` (equal weights when none reports examples)."""
        weights = self.selector.aggregation_weights(updates)
        if weights is None:
            weights = [u.num_examples for u in updates]
        if sum(weights) <= 0:
            weights = [1.0] * len(updates)
        return list(weights)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> ModelDict | None:
        """Turn the round's accepted updates into the server's next models; return the global
        model (None: unchanged). Override this."""
        raise NotImplementedError

    # ================================================================== state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run exactly: models, global model, RNG, selector.

        Subclasses with state of their own extend the dict (call ``super().state_dict()``).
        """
        return {
            "models": self.models,
            "global_model": self.global_model,
            "rng": self.rng.bit_generator.state,
            "selector": self.selector.state_dict(),
            "accepted_rounds": dict(self.accepted_rounds),
            "clock": self.clock.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.models = list(state["models"])
        self.global_model = state["global_model"]
        self.spec = protocol.array_spec(self.models[0])
        self.rng.bit_generator.state = state["rng"]
        self.selector.load_state_dict(state["selector"])
        self.accepted_rounds = {int(k): int(v) for k, v in state.get("accepted_rounds", {}).items()}
        if "clock" in state:  # checkpoints before the virtual clock have none
            self.clock.load_state_dict(state["clock"])

    # ================================================================== Flower Strategy API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per selected node: the model of its slot, its own config copy."""
        if self.models is None:
            initial = protocol.record_to_model(arrays)
            self.initialize(initial)
        assert self.models is not None
        if self.spec is None:
            self.spec = protocol.array_spec(self.models[0])
        self.round_log = {}
        node_ids = self.selector.select(grid, server_round, self.clients_per_round)
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_ids), self._connected(grid))
        self.round_log.update(self.selector.round_info)
        self.prepare_round(server_round, node_ids)
        encoded: dict[int, ArrayRecord] = {}  # encode each server model once per round
        messages = []
        for slot, node_id in enumerate(node_ids):
            index = self.model_for_slot(slot)
            if index not in encoded:
                encoded[index] = protocol.model_to_record(self.models[index])
            node_config = {**dict(config), protocol.SERVER_ROUND: server_round, protocol.MODEL_INDEX: index,
                           protocol.ACCEPTED_ROUND: self.accepted_rounds.get(node_id, 0)}
            messages.append(
                protocol.server_message(
                    protocol.TRAIN, node_id, node_config, encoded[index], self.extra_records(server_round, slot),
                    arrays_key=self.arrayrecord_key, config_key=self.configrecord_key,
                )
            )
        # Message ids are assigned when the grid pushes the messages: keep their metadata only
        # (the encoded models are the grid's to hold until the replies are in).
        self._pending = [msg.metadata for msg in messages]
        self._begin_replies(server_round)
        return messages

    def _connected(self, grid: Grid) -> int | str:
        """How many nodes the selector saw connected (for the sampling log line)."""
        known = getattr(self.selector, "last_connected", None)
        if known is not None:
            return known
        try:
            return len(list(grid.get_node_ids()))
        except Exception:  # noqa: BLE001 - a log line must not stop the round
            return "?"

    def _begin_replies(self, server_round: int) -> None:
        self._slot_of = None
        self._round_updates, self._round_seen, self._round_rejected = [], set(), []
        self._round_extras = self.reply_extras(server_round)

    # ================================================================== multi-phase rounds
    # A method whose round has several message phases (FedMR's secure recombination) sends its
    # own train-reply phase: it names the messages whose replies count, hands each reply to
    # accept_reply, and may mark a slot as failed; finish_train then aggregates as usual.
    def expect_replies(self, server_round: int, pending: list[Any]) -> None:
        """The slots of this round's train replies: ``pending[slot]`` is the metadata of the
        message whose reply fills that slot (anything with ``message_id`` and ``dst_node_id``).
        Forgets every reply accepted so far in this round."""
        self._pending = list(pending)
        self._begin_replies(server_round)

    def accepted_updates(self) -> list[ClientUpdate]:
        """The updates accepted so far in this round (in arrival order)."""
        return list(self._round_updates)

    def rejection(self, node_id: int) -> str | None:
        """Why a reply of ``node_id`` was rejected this round, or None."""
        prefixes = (f"node {node_id}:", f"node {node_id} (")
        return next((r.split(": ", 1)[-1] for r in self._round_rejected if r.startswith(prefixes)), None)

    def fail_slot(self, slot: int, reason: str) -> None:
        """Count ``slot`` as failed this round with ``reason`` (its model stays where it was)."""
        self._round_seen.add(slot)
        self._round_rejected.append(f"{self._where(self._pending[slot].dst_node_id, slot)}: {reason}")

    def accept_reply(self, reply: Message) -> None:
        """Decode and check one train reply of the current round as soon as it arrives; its
        serialized arrays are released as they are decoded (only the decoded model is kept)."""
        assert self.spec is not None
        if self._slot_of is None:
            self._slot_of = {metadata.message_id: slot for slot, metadata in enumerate(self._pending)}
        slot = self._slot_of.get(reply.metadata.reply_to_message_id)
        if slot is None:
            self._round_rejected.append(f"node {reply.metadata.src_node_id}: reply to an unknown message")
            return
        # the node the message was sent to: an error reply that Flower builds for a lost node
        # (e.g. "Reply message objects are unavailable") carries the ServerApp's own node id
        node = self._pending[slot].dst_node_id
        where = self._where(node, slot)
        self._round_seen.add(slot)
        update, reason = protocol.decode_train_reply(
            reply, slot, self.spec, self._round_extras, consume=True, copy=self.writable_updates,
            arrays_key=self.arrayrecord_key, weight_key=self.weighted_by_key,
        )
        if update is None:
            self._round_rejected.append(f"{where}: {reason}")
            return
        if any(u.slot == slot for u in self._round_updates):
            self._round_rejected.append(f"{where}: duplicate reply")
            return
        bound, source = self.examples_bound(node)
        if bound is not None and update.num_examples > bound:
            self._round_rejected.append(f"{where}: {protocol.printable(self.weighted_by_key)}={update.num_examples:.0f} "
                                        f"exceeds {source} ({bound})")
            return
        self._round_updates.append(update)

    def close_virtual_round(self, updates: list[ClientUpdate], rejected: list[str]) -> list[ClientUpdate]:
        """The round on the virtual clock (:meth:`~strategies.heterogeneity.VirtualClock.close_round`):
        replies of stragglers past ``heterogeneity.deadline`` and of clients that were or went
        offline are rejected; ``virtual_time`` goes into the round's log."""
        nodes = [metadata.dst_node_id for metadata in self._pending]
        kept, late = self.clock.close_round(nodes, updates, self.selector)
        rejected.extend(f"{self._where(nodes[slot], slot)}: {reason}" for slot, reason in late)
        self.round_log["virtual_time"] = self.clock.now
        return kept

    def defend(self, updates: list[ClientUpdate], sent: list[ModelDict], names: list[str],
               rejected: list[str]) -> list[ClientUpdate]:
        """The defence stage (:mod:`strategies.defence`) on the round's accepted ``updates``
        (``sent[i]``: the model ``updates[i]`` was sent, ``names[i]``: how logs name its node):
        the updates kept, each screened reply's reason added to ``rejected``."""
        verdict = Defence(self.settings.defence).screen_and_bound(updates, sent)
        by_id = {id(u): name for u, name in zip(updates, names)}
        rejected.extend(f"{by_id[id(u)]}: {reason}" for u, reason in verdict.rejected)
        self.round_log.update(verdict.log)
        return verdict.kept

    def client_mean(self, models: list[ModelDict], own: Callable[[], ModelDict]) -> ModelDict:
        """The mean the method takes of client models: ``defence.robust_mean`` of ``models``
        when one is set, else the method's own mean, ``own()``."""
        robust = self.robust_mean_of(models)
        return own() if robust is None else robust

    def robust_mean_of(self, models: list[ModelDict]) -> ModelDict | None:
        """``defence.robust_mean`` of ``models`` (unweighted), or None when it is off."""
        defence = self.settings.defence
        if defence.robust_mean == "none" or not models:
            return None
        return robust_mean_models(models, defence.robust_mean, defence.trim_fraction)

    def examples_bound(self, node_id: int) -> tuple[int | None, str]:
        """The largest ``num-examples`` a reply of ``node_id`` may report, and where it comes
        from: the node's size in the roster, else ``max_num_examples``."""
        reported = getattr(self.selector, "num_examples", lambda _n: None)(node_id)
        if reported is not None:
            return int(reported), "the size the node reported in the roster"
        cap = getattr(self.settings, "max_num_examples", None)
        return (int(cap), "strategy.max_num_examples") if cap is not None else (None, "")

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and check every reply, hand the accepted ones to the method, aggregate."""
        for reply in replies:
            self.accept_reply(reply)
        return self.finish_train(server_round)

    def finish_train(self, server_round: int) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """After the replies of the round went through :meth:`accept_reply`: log what was
        rejected or missing, hand the accepted updates to the method, aggregate."""
        updates, seen, rejected = self._round_updates, self._round_seen, self._round_rejected
        self._round_updates, self._round_seen, self._round_rejected = [], set(), []
        for slot, metadata in enumerate(self._pending):
            if slot not in seen:
                rejected.append(f"{self._where(metadata.dst_node_id, slot)}: no reply within the round timeout")
        sent = len(self._pending)
        updates = self.close_virtual_round(updates, rejected)
        self._pending, self._slot_of = [], None
        updates.sort(key=lambda u: u.slot)
        if updates and self.models:
            models_sent = [self.models[self.model_for_slot(u.slot)] for u in updates]
            updates = self.defend(updates, models_sent, [self._where(u.node_id, u.slot) for u in updates], rejected)
            self.selector.observe(server_round, updates, [self.models[self.model_for_slot(u.slot)] for u in updates])
        self.last_replies = len(updates)
        self.last_rejections = rejected
        log(INFO, "aggregate_train: Received %s results and %s failures (round %d: %d/%d replies accepted)",
            len(updates), sent - len(updates), server_round, len(updates), sent)
        for reason in rejected:
            log(WARNING, "\t> rejected: %s", reason)
        logged = sorted({k for u in updates for k in u.metrics} - {self.weighted_by_key, *protocol.TRAINING_METRICS})
        for key in logged:  # a client objective's own metrics
            self.round_log[key.replace("-", "_")] = float(np.mean([u.metrics[key] for u in updates if key in u.metrics]))
        for update in updates:
            self.on_update(server_round, update)
        metrics = self.train_metrics(updates)
        previous = (list(self.models or []), self.global_model)
        global_model = self.aggregate(server_round, updates)
        bad = non_finite_key(global_model) or next((k for m in self.models or [] if (k := non_finite_key(m))), None)
        if bad:
            # never let a non-finite aggregate replace the models: keep the previous ones
            self.models, self.global_model = previous
            log(ERROR, "round %d: the aggregate has NaN/Inf in %s; the models of the previous round are kept", server_round, bad)
            self.last_replies = 0
            if "replies" in metrics:
                metrics["replies"] = 0.0
            return None, metrics
        if global_model is not None:
            self.global_model = global_model
        for update in updates:
            self.accepted_rounds[update.node_id] = server_round
        # The server's arrays are never written in place from here on, so a state_dict() taken
        # after a round stays that round's state (checkpoints, the non-finite fallback above).
        for model in [*(self.models or []), self.global_model or {}]:
            for value in model.values():
                value.setflags(write=False)
        arrays = None if global_model is None else protocol.model_to_record(global_model)
        return arrays, metrics

    def train_metrics(self, updates: list[ClientUpdate]) -> MetricRecord:
        """The round's aggregated train metrics: ``train_metrics_aggr_fn`` over the accepted
        replies' metrics, or the example-weighted mean plus the count of accepted ``replies``."""
        if self.train_metrics_aggr_fn is not None:
            if not updates:
                return MetricRecord()
            return self.train_metrics_aggr_fn(
                [RecordDict({protocol.METRICS: MetricRecord(u.metrics)}) for u in updates], self.weighted_by_key)
        metrics = protocol.weighted_metrics((u.metrics for u in updates), self.weighted_by_key) if updates else {}
        metrics["replies"] = float(len(updates))
        return MetricRecord(metrics)

    def _where(self, node: int, slot: int) -> str:
        """How log lines name a node: with the model index when the server keeps several models."""
        return f"node {node}" + (f" (model {self.model_for_slot(slot)})" if self.models and len(self.models) > 1 else "")

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation of the global model on a seeded ``fraction_evaluate`` of the nodes."""
        if self.fraction_evaluate <= 0.0:
            return []
        num_nodes = len(list(grid.get_node_ids()))
        size = max(1, min(num_nodes, int(num_nodes * self.fraction_evaluate)))
        node_config = {**dict(config), protocol.SERVER_ROUND: server_round}
        node_ids = self.selector.select(grid, server_round, size, stream=1)
        log(INFO, "configure_evaluate: Sampled %s nodes (out of %s)", len(node_ids), num_nodes)
        return [protocol.server_message(protocol.EVALUATE, n, node_config, arrays, arrays_key=self.arrayrecord_key,
                                        config_key=self.configrecord_key) for n in node_ids]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted mean of the metrics of the valid evaluate replies (no error, every
        metric finite, ``num-examples`` a count, ``accuracy`` in [0, 1], ``loss`` >= 0); each
        rejected reply is logged with its node and reason."""
        valid, contents = [], []
        rejected: dict[str, list[int]] = {}  # one line per reason, however many nodes gave it
        replies = list(replies)
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                reason = f"client error: {protocol.printable(protocol.client_error(reply.error.reason))}"
                if "No evaluate function registered" in reply.error.reason:
                    reason = "the ClientApp has no evaluate handler (set fraction_evaluate=0, or add @app.evaluate())"
                rejected.setdefault(reason, []).append(node)
                continue
            metrics = protocol.reply_metrics(reply)
            reason = protocol.check_evaluate_metrics(metrics, self.weighted_by_key)
            if reason:
                rejected.setdefault(reason, []).append(node)
                continue
            valid.append(metrics)
            contents.append(RecordDict({protocol.METRICS: MetricRecord(metrics)}))
        log(INFO, "aggregate_evaluate: Received %s results and %s failures", len(valid), len(replies) - len(valid))
        for reason, nodes in rejected.items():
            shown = ", ".join(str(n) for n in nodes[:3]) + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")
            log(WARNING, "round %d: %d evaluate repl%s rejected (node %s): %s", server_round, len(nodes),
                "y" if len(nodes) == 1 else "ies", shown, reason)
        if not valid:
            return None
        if self.evaluate_metrics_aggr_fn is not None:
            return self.evaluate_metrics_aggr_fn(contents, self.weighted_by_key)
        return MetricRecord(protocol.weighted_metrics(valid, self.weighted_by_key))

    def summary(self) -> None:
        """Log the strategy's sampling, record keys and settings (after Flower's start lines).

        Called by another strategy's ``start`` (a wrapper such as Flower's ``DifferentialPrivacy*``
        strategies, which run Flower's own loop around this one), it raises
        :class:`WrapperRefused` instead: see :func:`refuse_wrapper`."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_locals.get("self") is self:  # its own start, a subclass's summary
            frame = frame.f_back
        refuse_wrapper(self, frame.f_locals.get("self") if frame is not None else None)
        log(INFO, "\t├──> Sampling:")
        log(INFO, "\t│\t├──Nodes per round: train (%d) | evaluate (fraction %.2f)", self.clients_per_round,
            self.fraction_evaluate)
        log(INFO, "\t│\t└──Selector: %s", self.selector.describe())
        models = self.num_models if hasattr(self, "num_models") else 1
        if models > 1:
            log(INFO, "\t├──> Models: %d on the server, one per selected node%s", models,
                " (each evaluated after every round)" if self.evaluate_models else "")
        log(INFO, "\t├──> Keys in records:")
        log(INFO, "\t│\t├── Weighted by: '%s'", self.weighted_by_key)
        log(INFO, "\t│\t├── ArrayRecord key: '%s'", self.arrayrecord_key)
        log(INFO, "\t│\t└── ConfigRecord key: '%s'", self.configrecord_key)
        log(INFO, "\t└──> Settings: %s", ", ".join(f"{k}={v}" for k, v in self.settings.to_dict().items() if k != "name"))

    # ================================================================== the loop
    def send(
        self,
        grid: Grid,
        messages: list[Message],
        timeout: float,
        on_reply: Callable[[Message], None] | None = None,
    ) -> list[Message]:
        """One phase: push ``messages`` and collect the replies as they arrive (nothing is sent
        for no message); stop waiting after ``timeout`` seconds or when a stop is requested.

        ``messages`` is emptied once pushed: from then on only the grid holds them (until
        their replies are in). With ``on_reply`` every reply is handed to it as soon as it is
        pulled and not kept (an empty list is returned); without, the replies are returned.
        """
        if not messages:
            return []
        batch = list(messages)
        messages.clear()
        return exchange(grid, batch, timeout, on_reply)

    def run_round(
        self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord, timeout: float
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The training part of one round: every reply is decoded as it arrives
        (:meth:`accept_reply`), then the method aggregates (:meth:`finish_train`). One phase by
        default; a method with several phases overrides this and calls :meth:`send` per phase."""
        messages = list(self.configure_train(server_round, arrays, config, grid))
        self.send(grid, messages, timeout, on_reply=self.accept_reply)
        return self.finish_train(server_round)

    def start(  # noqa: PLR0913 - Flower's signature plus resume
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        *,
        start_round: int = 1,
        round_end: RoundEnd | None = None,
        max_failed_rounds: int | None = None,
        final_report: bool = True,
        return_models: bool = True,
    ) -> MultiModelResult:
        """Run rounds ``start_round`` .. ``num_rounds``; logs as Flower's strategies do.

        With ``start_round > 1`` the strategy continues from its current state (restored with
        :meth:`load_state_dict`): no initial evaluation, ``initial_arrays`` is ignored. After
        ``max_failed_rounds`` consecutive rounds in which no reply was accepted, raise
        :class:`RunFailed` (None: never). ``final_report``: log the whole :class:`Result` at the
        end, as Flower does (the fedmm runner writes files instead). ``return_models``: put the
        server's models in :attr:`MultiModelResult.models` (a copy of each; the fedmm runner
        writes them from the strategy instead).
        """
        log(INFO, "Starting %s strategy:", type(self).__name__)
        log(INFO, "\t├── Number of rounds: %d%s", num_rounds, f" (from round {start_round})" if start_round > 1 else "")
        log(INFO, "\t├── ArrayRecord (%.2f MB)", sum(len(a.data) for a in initial_arrays.values()) / (1024**2))
        log(INFO, "\t├── ConfigRecord (train): %s", _config_text(train_config))
        log(INFO, "\t├── ConfigRecord (evaluate): %s", _config_text(evaluate_config))
        self.summary()
        log(INFO, "")
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = MultiModelResult()
        t_start = time.time()
        if start_round <= 1:
            arrays = initial_arrays
            if evaluate_fn:
                res = evaluate_fn(0, arrays)
                log(INFO, "Initial global evaluation results: %s", _metrics_text(res))
                if res is not None:
                    result.evaluate_metrics_serverapp[0] = res
        else:
            if self.models is None or self.global_model is None:
                raise RuntimeError(f"start_round={start_round} needs the strategy's state: call load_state_dict first")
            arrays = protocol.model_to_record(self.global_model)
            result.arrays = arrays
        failed_rounds = 0
        for current_round in range(max(1, start_round), num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
            agg_arrays, train_metrics = self.run_round(current_round, grid, arrays, train_config, timeout)
            failed_rounds = failed_rounds + 1 if self.last_replies == 0 else 0
            if max_failed_rounds and failed_rounds >= max_failed_rounds:
                first = current_round - failed_rounds + 1
                why = self.last_rejections[0] if self.last_rejections else "no node was selected"
                raise RunFailed(
                    f"no client reply was accepted in {failed_rounds} consecutive rounds ({first}..{current_round}; "
                    f"max_failed_rounds={max_failed_rounds}); e.g. {why}"
                )
            if agg_arrays is not None:
                result.arrays = arrays = agg_arrays
            if train_metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", _metrics_text(train_metrics))
                result.train_metrics_clientapp[current_round] = train_metrics
            if self.round_log:  # the method's own quantities of the round
                log(INFO, "\t└──> %s: %s", type(self).__name__, _metrics_text(self.round_log))
            eval_replies = self.send(grid, list(self.configure_evaluate(current_round, arrays, evaluate_config, grid)), timeout)
            self.last_evaluate_metrics = None
            if eval_replies:
                eval_metrics = self.aggregate_evaluate(current_round, eval_replies)
                if eval_metrics is not None:
                    log(INFO, "\t└──> Aggregated MetricRecord: %s", _metrics_text(eval_metrics))
                    result.evaluate_metrics_clientapp[current_round] = eval_metrics
                    self.last_evaluate_metrics = dict(eval_metrics)
            if evaluate_fn:
                log(INFO, "Global evaluation")
                res = evaluate_fn(current_round, arrays)
                log(INFO, "\t└──> MetricRecord: %s", _metrics_text(res))
                if res is not None:
                    result.evaluate_metrics_serverapp[current_round] = res
                if self.evaluate_models and self.models:
                    result.evaluate_metrics_models[current_round] = self.evaluate_each_model(current_round, evaluate_fn)
            if round_end:
                round_end(current_round, arrays, result)
        if return_models:
            result.models = [protocol.model_to_record(m) for m in self.models or []]
        log(INFO, "")
        log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
        if final_report:
            log(INFO, "")
            log(INFO, "Final results:")
            log(INFO, "")
            for line in io.StringIO(str(result)):
                log(INFO, "\t%s", line.strip("\n"))
            log(INFO, "")
        return result

    def evaluate_each_model(
        self, server_round: int, evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None]
    ) -> list[MetricRecord]:
        """``evaluate_fn`` on each of the server's models (those it sends out next round), logged
        one line per model; a model the function returns None for gets an empty record."""
        records = []
        for index, model in enumerate(self.models or []):
            res = evaluate_fn(server_round, protocol.model_to_record(model))
            log(INFO, "\t└──> model %d: %s", index, _metrics_text(res))
            records.append(res if res is not None else MetricRecord())
        return records


def _config_text(config: ConfigRecord | None) -> str:
    """A ConfigRecord for the start lines: keys and short values (a long value by its size)."""
    if not config:
        return "(empty!)"
    parts = []
    for key, value in config.items():
        text = repr(value)
        parts.append(f"'{key}': {text if len(text) <= 40 else f'<{len(text)} characters>'}")
    return "{" + ", ".join(parts) + "}"
