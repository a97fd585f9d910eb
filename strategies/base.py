"""The Flower face of every method: a ``Strategy`` whose run lives in its context.

:class:`FedmmStrategy` is what a method (:class:`strategies.method.Method`) subclasses: Flower's
``Strategy`` interface (``start``, ``configure_train``, ``aggregate_train``, ``configure_evaluate``,
``aggregate_evaluate``, ``summary``) and the method's own state (its settings, K, N, seed, RNG,
models, global model, the numbers of its round). Everything else a run needs (the client
selector, the virtual clock, the reply ledger, observers, the stages of the round's end, the
server optimizer, the driver) is the run context's (:class:`strategies.context.RunContext`,
``strategy.context``), which every Flower call is handed to. Compared with Flower's own
``Strategy.start`` it can

- start at any round from a checkpoint (``start(..., start_round=r)`` after ``context.load_state_dict``);
- run several ``send_and_receive`` phases inside one round (its driver);
- call back after every round (``round_end``), where the runner writes checkpoints.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedmm.observers import RunObserver
from fedmm.protocol import ModelDict
from fedmm.settings import merged
from strategies.evaluation import Conventions, EvaluateFn
from strategies.contract import Participants  # noqa: F401 - what a method is told of a round's nodes, re-exported
from strategies.heterogeneity import LocalWork
from strategies.ledger import RunFailed  # noqa: F401 - raised by the loop, re-exported
from strategies.loop_log import MultiModelResult
from strategies.selection import ClientSelector
from strategies.server_optimizer import ServerOptimizer
from strategies.strategy_settings import StrategySettings
from strategies.wrappers import refuse_wrapper


#: Constructor arguments renamed, each with its new name (the old one still works, with a DeprecationWarning).
RENAMED_ARGUMENTS = {"num_models": "clients_per_round"}


class FedmmStrategy(Strategy):
    """The Flower ``Strategy`` every method is (module docstring).

    Parameters
    ----------
    clients_per_round : int
        K: nodes selected per round (and models kept, for the multi-model methods).
        ``num_models=`` is its deprecated name.
    seed : int
        The seed of the default selector and of the method's own randomness (``self.rng``).
    fraction_evaluate : float, optional
        Share of the connected nodes that evaluate the global model each round (a setting).
    selector : ClientSelector, optional
        Which nodes take part (default: :class:`~strategies.selection.SeededRosterSelector`, no roster query).
    settings : StrategySettings, optional
        The method's settings (default: the declared defaults).
    num_clients : int, optional
        N: the nodes of the federation, for a method whose arithmetic counts them (FedDyn, SCAFFOLD).
    work : LocalWork, optional
        How the virtual clock models the clients' local work (default: the clock's own).
    observers : iterable of RunObserver, optional
        What sees the rounds (:mod:`fedmm.observers`).
    server_optimizer : ServerOptimizer, optional
        How the server steps the model a one-model method trains next (:mod:`strategies.server_optimizer`).
    weighted_by_key, arrayrecord_key, configrecord_key, train_metrics_aggr_fn, evaluate_metrics_aggr_fn, evaluate_models
        Flower's record conventions and per-model evaluation (:class:`~strategies.evaluation.Conventions`).
    **changes
        Settings to change from ``settings`` (validated): ``FedMR(4, 0, first_stage_rounds=5)``.
    """

    #: The method's settings declaration.
    Settings: ClassVar[type[StrategySettings]] = StrategySettings

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Settings" in cls.__dict__:  # the declaration knows what it builds
            cls.Settings.strategy_class = cls

    def __init__(self, clients_per_round: int | None = None, seed: int = 0, fraction_evaluate: float | None = None,
                 selector: ClientSelector | None = None, *, settings: StrategySettings | None = None,
                 num_clients: int | None = None, work: LocalWork | None = None, observers: Iterable[RunObserver] = (),
                 server_optimizer: ServerOptimizer | None = None, **changes: Any) -> None:
        for old, new in RENAMED_ARGUMENTS.items():
            if old in changes:
                warnings.warn(f"{type(self).__name__}({old}=...) is deprecated: use {new}= (the same value)",
                              DeprecationWarning, stacklevel=3)
                value = changes.pop(old)
                if clients_per_round is not None and clients_per_round != value:
                    raise TypeError(f"{type(self).__name__} got {new}={clients_per_round} and {old}={value}")
                clients_per_round = value
        if clients_per_round is None:
            raise TypeError(f"{type(self).__name__}() missing the argument clients_per_round (K: nodes per round)")
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        if num_clients is not None and num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        if fraction_evaluate is not None:
            changes["fraction_evaluate"] = fraction_evaluate
        conventions = Conventions.take(changes)
        settings = settings if settings is not None else self.Settings()
        if not isinstance(settings, self.Settings):
            raise TypeError(f"{type(self).__name__} takes {self.Settings.__name__}, got {type(settings).__name__}")
        for key in [k for k in changes if k in self.Settings.retired and k not in self.Settings.__dataclass_fields__]:
            moved = self.Settings.retired[key](changes.pop(key))  # a setting that moved: {group: {key: value}}
            warnings.warn(f"{type(self).__name__}({key}=...) is deprecated: use " + ", ".join(f"{group}={value!r}" for group,
                          value in moved.items()), DeprecationWarning, stacklevel=3)
            changes = merged(merged({group: changes.get(group, settings.to_dict()[group]) for group in moved}, moved),
                             {k: v for k, v in changes.items() if k not in moved})
        #: The method's settings (read-only).
        self.settings = settings.replace(**changes) if changes else settings
        #: K, N (None: not known) and the seed.
        self.clients_per_round, self.num_clients, self.seed = int(clients_per_round), num_clients, seed
        #: The method's own randomness.
        self.rng = np.random.default_rng([seed, 0x5EED])
        #: The server's models (one for FedAvg; K for the multi-model methods).
        self.models: list[ModelDict] | None = None
        #: The model evaluated and saved as the run's result.
        self.global_model: ModelDict | None = None
        #: Numbers about the round (the method's own, e.g. FedExP's step size, and the stages'),
        #: written into the round's row of ``metrics.jsonl``; emptied when every round starts.
        self.round_log: dict[str, float] = {}
        from strategies.context import RunContext  # the context runs methods: it comes after them

        #: The run: selector, clock, replies, observers, the round's end stages, the driver.
        self.context = RunContext(self, selector, work, observers, server_optimizer, conventions)

    # ================================================================== Flower's Strategy API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """One train message per selected node, each with the model of its slot (the driver's)."""
        return self.context.driver.configure(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply, then end the round (the driver's)."""
        return self.context.driver.aggregate(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Federated evaluation of the global model on a seeded ``fraction_evaluate`` of the nodes."""
        return self.context.evaluation.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted mean of the metrics of the valid evaluate replies."""
        return self.context.evaluation.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        """Log the strategy's sampling, record keys and settings (after Flower's start lines).

        Called by another strategy's ``start`` (a wrapper such as Flower's ``DifferentialPrivacy*``
        strategies, which run Flower's own loop around this one), it raises
        :class:`~strategies.wrappers.WrapperRefused` instead."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_locals.get("self") in (self, self.context):  # its own start
            frame = frame.f_back
        refuse_wrapper(self, frame.f_locals.get("self") if frame is not None else None)
        self.context.log_summary()

    def start(  # noqa: PLR0913 - Flower's signature plus resume
        self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
        train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None, should_stop: Any = None, *, start_round: int = 1, round_end: Any = None,
        max_failed_rounds: int | None = None, final_report: bool = True, return_models: bool = True,
    ) -> MultiModelResult:
        """Run rounds ``start_round`` .. ``num_rounds`` (:meth:`strategies.context.RunContext.start`);
        logs as Flower's strategies do. With ``start_round > 1`` it goes on from the state
        ``context.load_state_dict`` restored. ``should_stop(round, result)`` (Flower 1.43's, taken
        on every Flower): True after a round ends the run there, as the run's own stop."""
        return self.context.start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn,
                                  should_stop, start_round=start_round, round_end=round_end,
                                  max_failed_rounds=max_failed_rounds, final_report=final_report,
                                  return_models=return_models)
