"""The Flower face of every method: a ``Strategy`` that owns ``start`` and hands each round to a driver.

:class:`FedmmStrategy` holds what a run needs besides the method's arithmetic: the settings, the
client selector, the virtual clock, the reply ledger, Flower's record conventions, checkpoints'
state, and the driver that runs a round (:class:`strategies.rounds.SyncRound`; the asynchronous
loop, :class:`strategies.asynchronous.AsyncRound`; secure recombination's phases). A method
(:class:`strategies.method.Method`) subclasses it and adds its models and arithmetic only.
Compared with Flower's own ``Strategy.start`` it can

- start at any round from a checkpoint (``start(..., start_round=r)`` after :meth:`load_state_dict`);
- run several ``send_and_receive`` phases inside one round (its driver calls :meth:`send` per phase);
- call back after every round (``round_end``), where the runner writes checkpoints.

Nodes that fail, time out or send a reply that fails validation lose nothing: the model they
were given stays where it was. Its parts have modules of their own: the reply check and a round's
bookkeeping (:mod:`strategies.ledger`), evaluation and reply metrics (:mod:`strategies.evaluation`),
the result and the log lines (:mod:`strategies.loop_log`), the push/pull loop
(:mod:`strategies.messaging`), the start and end of every round (:mod:`strategies.rounds`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from logging import INFO
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from fedmm import protocol
from fedmm.observers import Observers, RunObserver
from fedmm.protocol import ModelDict
from strategies.evaluation import Conventions, EvaluateFn, FederatedEvaluation
from strategies.heterogeneity import LocalWork, VirtualClock
from strategies.ledger import ReplyLedger, RoundOutcome
from strategies.loop_log import MultiModelResult, log_end, log_round, log_start, log_summary
from strategies.privacy import Privacy
from strategies.selection import ClientSelector, SeededRosterSelector
from strategies.server_optimizer import ServerOptimizer
from strategies.strategy_settings import StrategySettings
from strategies.wrappers import refuse_wrapper


class RunFailed(RuntimeError):
    """The run cannot go on (e.g. no client reply was accepted for ``max_failed_rounds`` rounds)."""


#: Called after every round with (round, global arrays, result so far).
RoundEnd = Callable[[int, ArrayRecord, Result], None]


@dataclass(frozen=True)
class Participants:
    """The round's selected nodes, in slot order: their ids, their stable keys (partition id or
    data path, across runs), and the training-set sizes the nodes reported in the roster query
    (every node that reported one, selected or not)."""

    ids: list[int]
    keys: list[str]
    sizes: dict[int, float]


class FedmmStrategy(FederatedEvaluation):
    """The Flower ``Strategy`` every method is (module docstring); its driver runs the rounds.

    Parameters
    ----------
    clients_per_round, seed : int
        K: nodes selected per round (and models kept, for the multi-model methods); the seed of
        the default selector and of the method's own randomness (``self.rng``).
    fraction_evaluate : float, optional
        Share of the connected nodes that evaluate the global model each round (a setting).
    selector : ClientSelector, optional
        Which nodes take part (default: :class:`SeededRosterSelector`, no roster query).
    settings : StrategySettings, optional
        The method's settings (default: the declared defaults).
    num_clients : int, optional
        N: the nodes of the federation, for a method whose arithmetic counts them (FedDyn, SCAFFOLD).
    work : LocalWork, optional
        How the virtual clock models the clients' local work (default: the clock's own).
    observers : iterable of RunObserver, optional
        What sees the rounds (:mod:`fedmm.observers`): phases, the defence stage's verdicts, the
        updates aggregated, the start and end.
    server_optimizer : ServerOptimizer, optional
        How the server steps the model a one-model method trains next (:mod:`strategies.server_optimizer`;
        default: the method's own step).
    weighted_by_key, arrayrecord_key, configrecord_key, train_metrics_aggr_fn, evaluate_metrics_aggr_fn, evaluate_models
        Flower's record conventions and per-model evaluation (:class:`~strategies.evaluation.Conventions`).
    **changes
        Settings to change from ``settings`` (validated): ``FedMR(4, 0, first_stage_rounds=5)``.
    """

    #: The method's settings declaration.
    Settings: ClassVar[type[StrategySettings]] = StrategySettings
    #: True when the method writes into the arrays of the updates it gets (FedCross fuses in
    #: place): replies are then decoded into new writable arrays, else read-only views of their bytes.
    writable_updates: ClassVar[bool] = False
    #: The driver of its rounds (:class:`strategies.rounds.SyncRound` for a method, set in
    #: :mod:`strategies.method`; the asynchronous one, :class:`strategies.asynchronous.AsyncRound`).
    Driver: ClassVar[Any] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Settings" in cls.__dict__:  # the declaration knows what it builds
            cls.Settings.strategy_class = cls

    def __init__(self, clients_per_round: int, seed: int, fraction_evaluate: float | None = None,
                 selector: ClientSelector | None = None, *, settings: StrategySettings | None = None,
                 num_clients: int | None = None, work: LocalWork | None = None, observers: Iterable[RunObserver] = (),
                 server_optimizer: ServerOptimizer | None = None, **changes: Any) -> None:
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        if num_clients is not None and num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        if fraction_evaluate is not None:
            changes["fraction_evaluate"] = fraction_evaluate
        #: Flower's record conventions and per-model evaluation, read as attributes (not settings).
        self.conventions = Conventions.take(changes)
        settings = settings if settings is not None else self.Settings()
        if not isinstance(settings, self.Settings):
            raise TypeError(f"{type(self).__name__} takes {self.Settings.__name__}, got {type(settings).__name__}")
        self.settings = settings.replace(**changes) if changes else settings
        self.clients_per_round, self.seed, self.num_clients = clients_per_round, seed, num_clients
        # A strategy made in any Flower app sends no roster query (its ClientApp may have no
        # query handler); the fedmm app turns it on (from_settings).
        self.selector = selector or SeededRosterSelector(seed, query=False)
        self.rng = np.random.default_rng([seed, 0x5EED])
        #: Virtual time and the clients' speeds (strategies/heterogeneity.py).
        self.clock = VirtualClock(self.settings.heterogeneity, seed, work)
        #: The server's models (one for FedAvg; K for the multi-model methods).
        self.models: list[ModelDict] | None = None
        #: The model evaluated and saved as the run's result.
        self.global_model: ModelDict | None = None
        #: Replies accepted in the last round, and why the others were rejected.
        self.last_round = RoundOutcome()
        #: Numbers about the round (the method's own, e.g. FedExP's step size; the stage's), written
        #: into the round's row of ``metrics.jsonl``; emptied when every round starts.
        self.round_log: dict[str, float] = {}
        #: The train replies: the round's slots, accepted updates, rejections (strategies/ledger.py).
        self.replies = ReplyLedger(self.where)
        #: What sees the rounds (fedmm/observers.py).
        self.observers = observers if isinstance(observers, Observers) else Observers(observers)
        if server_optimizer is not None and not self.steps_one_model():
            raise ValueError(f"{type(self).__name__} takes no server optimizer (it keeps several models, or evaluates "
                             "another model than the one it trains next)")
        #: The server optimizer (None: the method's own step).
        self.optimizer = server_optimizer
        #: Central differential privacy (strategies/privacy.py; None: off).
        self.privacy = Privacy.attach(self)
        self.driver = self.driver_class(self.settings)(self)

    @classmethod
    def driver_class(cls, settings: StrategySettings) -> Any:
        """The driver of the rounds with ``settings`` (default: ``Driver``; FedMR's secure
        recombination has its own phases)."""
        return cls.Driver

    @classmethod
    def from_settings(cls, run: Any, observers: Iterable[RunObserver] = ()) -> FedmmStrategy:
        """The strategy of a run (:class:`fedmm.config.RunSettings`): K from ``clients_per_round``,
        N, the seed, the method's settings (:meth:`settings_for`), the client selector of
        ``selection`` (the seeded roster by default, with the roster query), the clock's work model."""
        settings = cls.settings_for(run)
        selector = run.selection.build(run)
        if selector is None:
            query = {protocol.ROSTER_EXAMPLES: 1, protocol.RUN_CONFIG: protocol.run_config_record(run)} \
                if cls.needs_sizes(settings) else None
            selector = SeededRosterSelector(run.seed, query_config=query, min_nodes_timeout=float(run.min_nodes_timeout) or None)
        return cls(run.clients_per_round, run.seed, selector=selector, settings=settings, num_clients=run.num_clients,
                   work=LocalWork.from_run(run), observers=observers, server_optimizer=run.server_optimizer.build())

    @classmethod
    def settings_for(cls, run: Any) -> StrategySettings:
        """The method's settings for a run (default: as validated; a method may resolve a value
        for the run's model or dataset, e.g. FedMR's ``first_stage_by_model``)."""
        return run.strategy

    @classmethod
    def needs_sizes(cls, settings: StrategySettings) -> bool:
        """Whether the roster query asks the nodes for their training-set sizes (an asynchronous
        driver on the virtual clock times each job from them; a method may need them too)."""
        return bool(cls.driver_class(settings).needs_sizes)

    def __getattr__(self, name: str) -> Any:
        for group in ("conventions", "settings"):  # self.weighted_by_key, self.alpha
            held = self.__dict__.get(group)
            if held is not None and name in type(held).__dataclass_fields__:
                return getattr(held, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def participants(self, node_ids: list[int]) -> Participants:
        """The round's selected nodes as a method sees them (:class:`Participants`)."""
        sizes = self.selector.all_num_examples() if isinstance(self.selector, SeededRosterSelector) else {}
        return Participants(list(node_ids), [self.selector.node_key(n) for n in node_ids], dict(sizes))

    def where(self, node: int, slot: int) -> str:
        """How log lines name a node: with the model index when the server keeps several models."""
        several = self.models is not None and len(self.models) > 1
        return f"node {node}" + (f" (model {self.model_for_slot(slot)})" if several else "")

    # ================================================================== Flower's Strategy API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """One train message per selected node, each with the model of its slot (the driver's)."""
        return self.driver.configure(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply, then end the round (the driver's)."""
        return self.driver.aggregate(server_round, replies)

    def summary(self) -> None:
        """Log the strategy's sampling, record keys and settings (after Flower's start lines).

        Called by another strategy's ``start`` (a wrapper such as Flower's ``DifferentialPrivacy*``
        strategies, which run Flower's own loop around this one), it raises
        :class:`~strategies.wrappers.WrapperRefused` instead."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_locals.get("self") is self:  # its own start, a subclass's summary
            frame = frame.f_back
        refuse_wrapper(self, frame.f_locals.get("self") if frame is not None else None)
        log_summary(self)
        if self.driver.describe():
            log(INFO, "\t└──> %s", self.driver.describe())

    # ================================================================== state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run exactly: models, global model, RNG, selector,
        clock, the driver's (a method with state of its own extends it: ``super().state_dict()``)."""
        state = {"models": self.models, "global_model": self.global_model, "rng": self.rng.bit_generator.state,
                 "selector": self.selector.state_dict(), "accepted_rounds": dict(self.replies.accepted_rounds),
                 "clock": self.clock.state_dict(), **self.driver.state_dict()}
        return {**state, **{name: part.state_dict() for name, part in self.parts().items()}}

    def parts(self) -> dict[str, Any]:
        """The stateful parts of the server's step beside the method, by checkpoint key."""
        return {name: part for name, part in (("server_optimizer", self.optimizer), ("privacy", self.privacy)) if part}

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
        for name, part in self.parts().items():
            part.load_state_dict(state[name])
        self.driver.load_state_dict(state)

    # ================================================================== the loop
    def start(  # noqa: PLR0913 - Flower's signature plus resume
        self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
        train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None, *, start_round: int = 1, round_end: RoundEnd | None = None,
        max_failed_rounds: int | None = None, final_report: bool = True, return_models: bool = True,
    ) -> MultiModelResult:
        """Run rounds ``start_round`` .. ``num_rounds``; logs as Flower's strategies do. With
        ``start_round > 1`` it goes on from its state (:meth:`load_state_dict`; ``initial_arrays``
        ignored). ``max_failed_rounds`` rounds in a row with no accepted reply raise :class:`RunFailed`.
        ``final_report``: log the whole :class:`Result`; ``return_models``: a copy of the server's
        models in :attr:`MultiModelResult.models`."""
        log_start(type(self).__name__, num_rounds, start_round, initial_arrays, train_config, evaluate_config)
        self.summary()
        self.observers.on_strategy_start(self)
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
            arrays = result.arrays = protocol.model_to_record(self.global_model)
        self.driver.start(num_rounds)
        failed_rounds = 0
        for current_round in range(max(1, start_round), num_rounds + 1):
            if self.privacy is not None and self.privacy.spent(current_round):
                break
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
            agg_arrays, train_metrics = self.driver.run(current_round, grid, arrays, train_config, timeout)
            failed_rounds = failed_rounds + 1 if self.last_round.replies == 0 else 0
            if max_failed_rounds and failed_rounds >= max_failed_rounds:
                first = current_round - failed_rounds + 1
                why = self.last_round.rejections[0] if self.last_round.rejections else "no node was selected"
                raise RunFailed(f"no client reply was accepted in {failed_rounds} consecutive rounds ({first}..{current_round}; "
                                f"max_failed_rounds={max_failed_rounds}); e.g. {why}")
            if agg_arrays is not None:
                result.arrays = arrays = agg_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[current_round] = train_metrics
            log_round(type(self).__name__, train_metrics, self.round_log)
            self.evaluate_round(current_round, grid, arrays, evaluate_config, timeout, evaluate_fn, result)
            if round_end:
                round_end(current_round, arrays, result)
            self.observers.on_round_end(current_round)
        if return_models:
            result.models = [protocol.model_to_record(m) for m in self.models or []]
        log_end(result, t_start, final_report)
        self.observers.on_strategy_end()
        return result
