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

Its parts have modules of their own: the reply check and a round's reply bookkeeping
(:mod:`strategies.ledger`), evaluation and reply metrics (:mod:`strategies.evaluation`), the
result and the log lines (:mod:`strategies.loop_log`), the push/pull loop
(:mod:`strategies.messaging`), the defence stage (:mod:`strategies.defence`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping
from logging import ERROR, INFO
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from fedmm import protocol
from fedmm.protocol import ClientUpdate, ModelDict
from strategies.aggregation import non_finite_key
from strategies.defence import check_model, defend
from strategies.evaluation import Conventions, EvaluateFn, FederatedEvaluation, client_metrics
from strategies.heterogeneity import VirtualClock
from strategies.ledger import ReplyCheck, ReplyLedger, RoundOutcome
from strategies.loop_log import MultiModelResult, connected, log_end, log_round, log_start, log_summary, log_train_round
from strategies.messaging import exchange
from strategies.selection import ClientSelector, SeededRosterSelector
from strategies.strategy_settings import StrategySettings
from strategies.wrappers import refuse_wrapper


class RunFailed(RuntimeError):
    """The run cannot go on (e.g. no client reply was accepted for ``max_failed_rounds`` rounds)."""


#: Called after every round with (round, global arrays, result so far).
RoundEnd = Callable[[int, ArrayRecord, Result], None]

class RoundLoopStrategy(FederatedEvaluation):
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
        accepted replies (default: the example-weighted mean, :func:`~strategies.evaluation.default_metrics_aggregation`).
    evaluate_models : bool, optional
        Also evaluate each of the server's models with ``evaluate_fn`` after every round (the K
        models of FedMR / FedCross): logged, and in :attr:`~strategies.loop_log.MultiModelResult.evaluate_metrics_models`.
    **changes
        Settings to change from ``settings`` (validated): ``FedMR(4, 0, first_stage_rounds=5)``.
    """

    #: The method's settings declaration.
    Settings: ClassVar[type[StrategySettings]] = StrategySettings

    #: True when the method writes into the arrays of the updates it gets (e.g. FedCross fuses
    #: in place): replies are then decoded into new writable arrays. False: read-only views of
    #: the reply's bytes, no copy.
    writable_updates = False

    #: Models the server keeps (the multi-model methods: K).
    num_models = 1

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
        #: Flower's record conventions and per-model evaluation, read as attributes (not settings).
        self.conventions = Conventions.take(changes)
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
        self.clock = VirtualClock(self.settings.heterogeneity, seed)
        #: The server's models (FedAvg: one; multi-model methods: K).
        self.models: list[ModelDict] | None = None
        #: The model evaluated and saved as the run's result.
        self.global_model: ModelDict | None = None
        #: Replies accepted in the last round, and why the others were rejected.
        self.last_round = RoundOutcome()
        #: Numbers a method reports about its own round (e.g. FedExP's server step size), written
        #: into the round's row of ``metrics.jsonl``; reset at the start of every round.
        self.round_log: dict[str, float] = {}
        #: The train replies: the round's slots, accepted updates, rejections (strategies/ledger.py).
        self.replies = ReplyLedger(self._where)

    @classmethod
    def from_settings(cls, run: Any) -> RoundLoopStrategy:
        """The strategy of a run's settings (:class:`fedmm.config.RunSettings`): K from
        ``clients_per_round``, the seed, the method's settings."""
        return cls(run.clients_per_round, run.seed, settings=run.strategy)

    def __getattr__(self, name: str) -> Any:
        for group in ("conventions", "settings"):  # self.weighted_by_key, self.alpha
            held = self.__dict__.get(group)
            if held is not None and name in type(held).__dataclass_fields__:
                return getattr(held, name)
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
            "accepted_rounds": dict(self.replies.accepted_rounds),
            "clock": self.clock.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.models = list(state["models"])
        self.global_model = state["global_model"]
        self.replies.spec = protocol.array_spec(self.models[0])
        self.rng.bit_generator.state = state["rng"]
        self.selector.load_state_dict(state["selector"])
        self.replies.accepted_rounds = {int(k): int(v) for k, v in state.get("accepted_rounds", {}).items()}
        if "clock" in state:  # checkpoints before the virtual clock have none
            self.clock.load_state_dict(state["clock"])

    # ================================================================== the round
    def begin_round(self, arrays: ArrayRecord) -> None:
        """What every round (synchronous, asynchronous, secure) starts with: the models from
        ``arrays`` the first time (:meth:`initialize`), the spec replies must match, an empty
        ``round_log``."""
        if self.models is None:
            self.initialize(protocol.record_to_model(arrays))
            check_model(self.settings.defence, self.models[0])
        assert self.models is not None
        if self.replies.spec is None:
            self.replies.spec = protocol.array_spec(self.models[0])
        self.round_log = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per selected node: the model of its slot, its own config copy."""
        self.begin_round(arrays)
        assert self.models is not None
        node_ids = self.selector.select(grid, server_round, self.clients_per_round)
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_ids), connected(self.selector, grid))
        self.round_log.update(self.selector.round_info)
        self.prepare_round(server_round, node_ids)
        encoded: dict[int, ArrayRecord] = {}  # encode each server model once per round
        messages = []
        for slot, node_id in enumerate(node_ids):
            index = self.model_for_slot(slot)
            if index not in encoded:
                encoded[index] = protocol.model_to_record(self.models[index])
            node_config = {**dict(config), protocol.SERVER_ROUND: server_round, protocol.MODEL_INDEX: index,
                           protocol.ACCEPTED_ROUND: self.replies.accepted_rounds.get(node_id, 0)}
            messages.append(
                protocol.server_message(
                    protocol.TRAIN, node_id, node_config, encoded[index], self.extra_records(server_round, slot),
                    arrays_key=self.arrayrecord_key, config_key=self.configrecord_key,
                )
            )
        # Message ids are assigned when the grid pushes the messages: keep their metadata only
        # (the encoded models are the grid's to hold until the replies are in).
        self.replies.expect_replies([msg.metadata for msg in messages], ReplyCheck.of(self, server_round))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and check every reply, hand the accepted ones to the method, aggregate."""
        for reply in replies:
            self.replies.accept_reply(reply)
        return self.finish_train(server_round)

    def finish_train(self, server_round: int) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """After the replies of the round went through the ledger: log what was rejected or
        missing, defend, hand the accepted updates to the method, aggregate."""
        updates, rejected, sent = self.replies.close_round(self.clock, self.selector)
        self.round_log["virtual_time"] = self.clock.now
        stand_ins: list[ClientUpdate] = []
        if updates and self.models:
            updates, stand_ins = self._defend(server_round, updates, rejected)
        self.last_round.replies, self.last_round.rejections = len(updates), rejected
        log_train_round(server_round, len(updates), sent, rejected)
        self.round_log.update(client_metrics(updates, self.weighted_by_key))
        for update in updates:
            self.on_update(server_round, update)
        metrics = self.train_metrics(updates)
        return self._aggregate_finite(server_round, updates + stand_ins, metrics), metrics

    def _defend(self, server_round: int, updates: list[ClientUpdate],
                rejected: list[str]) -> tuple[list[ClientUpdate], list[ClientUpdate]]:
        """The defence stage (:func:`strategies.defence.defend`) on the round's accepted updates,
        each against the model it was sent: the updates kept (the selector observes them) and the
        rejected ones' stand-ins (``refill``), which only :meth:`aggregate` sees."""
        assert self.models is not None
        sent = [self.models[self.model_for_slot(u.slot)] for u in updates]
        kept, stand_ins = defend(self.settings.defence, updates, sent, [self._where(u.node_id, u.slot) for u in updates],
                                 rejected, self.round_log)
        self.selector.observe(server_round, kept, [self.models[self.model_for_slot(u.slot)] for u in kept])
        return kept, stand_ins

    def _aggregate_finite(self, server_round: int, updates: list[ClientUpdate], metrics: MetricRecord) -> ArrayRecord | None:
        """:meth:`aggregate`, and the global arrays; an aggregate with NaN/Inf replaces nothing:
        the previous models stay and the round counts no accepted reply."""
        previous = (list(self.models or []), self.global_model)
        global_model = self.aggregate(server_round, updates)
        bad = non_finite_key(global_model) or next((k for m in self.models or [] if (k := non_finite_key(m))), None)
        if bad:
            self.models, self.global_model = previous
            log(ERROR, "round %d: the aggregate has NaN/Inf in %s; the models of the previous round are kept", server_round, bad)
            self.last_round.replies = 0
            if "replies" in metrics:
                metrics["replies"] = 0.0
            return None
        if global_model is not None:
            self.global_model = global_model
        self.replies.record_accepted(server_round, updates)
        # The server's arrays are never written in place from here on, so a state_dict() taken
        # after a round stays that round's state (checkpoints, the non-finite fallback above).
        for model in [*(self.models or []), self.global_model or {}]:
            for value in model.values():
                value.setflags(write=False)
        return None if global_model is None else protocol.model_to_record(global_model)

    def _where(self, node: int, slot: int) -> str:
        """How log lines name a node: with the model index when the server keeps several models."""
        return f"node {node}" + (f" (model {self.model_for_slot(slot)})" if self.models and len(self.models) > 1 else "")

    def summary(self) -> None:
        """Log the strategy's sampling, record keys and settings (after Flower's start lines).

        Called by another strategy's ``start`` (a wrapper such as Flower's ``DifferentialPrivacy*``
        strategies, which run Flower's own loop around this one), it raises
        :class:`WrapperRefused` instead: see :func:`refuse_wrapper`."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_locals.get("self") is self:  # its own start, a subclass's summary
            frame = frame.f_back
        refuse_wrapper(self, frame.f_locals.get("self") if frame is not None else None)
        log_summary(self)

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
        """The training part of one round: every reply is checked as it arrives (the ledger's
        :meth:`~strategies.ledger.ReplyLedger.accept_reply`), then the method aggregates
        (:meth:`finish_train`). One phase by default; a method with several phases overrides
        this and calls :meth:`send` per phase."""
        messages = list(self.configure_train(server_round, arrays, config, grid))
        self.send(grid, messages, timeout, on_reply=self.replies.accept_reply)
        return self.finish_train(server_round)

    def start(  # noqa: PLR0913 - Flower's signature plus resume
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
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
        log_start(type(self).__name__, num_rounds, start_round, initial_arrays, train_config, evaluate_config)
        self.summary()
        log(INFO, "")
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = MultiModelResult()
        t_start = time.time()
        if start_round <= 1:
            arrays = initial_arrays
            self.evaluate_initial(arrays, evaluate_fn, result)
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
            failed_rounds = failed_rounds + 1 if self.last_round.replies == 0 else 0
            if max_failed_rounds and failed_rounds >= max_failed_rounds:
                first = current_round - failed_rounds + 1
                why = self.last_round.rejections[0] if self.last_round.rejections else "no node was selected"
                raise RunFailed(
                    f"no client reply was accepted in {failed_rounds} consecutive rounds ({first}..{current_round}; "
                    f"max_failed_rounds={max_failed_rounds}); e.g. {why}"
                )
            if agg_arrays is not None:
                result.arrays = arrays = agg_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[current_round] = train_metrics
            log_round(type(self).__name__, train_metrics, self.round_log)
            self.evaluate_round(current_round, grid, arrays, evaluate_config, timeout, evaluate_fn, result)
            if round_end:
                round_end(current_round, arrays, result)
        if return_models:
            result.models = [protocol.model_to_record(m) for m in self.models or []]
        log_end(result, t_start, final_report)
        return result
