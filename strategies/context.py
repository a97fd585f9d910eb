"""The run context: everything a run holds besides the method.

A method (:class:`strategies.method.Method`) is its models and its arithmetic. What runs it is
its :class:`RunContext` (``strategy.context``): the client selector, the virtual clock, the
reply ledger, the observers, Flower's record conventions, the stages of every round's end
(:mod:`strategies.stages`: the DP clip, the defence screens, the trust stage, the selector's
observation, the weighting, the method's aggregate, the DP release, the server optimizer, the NaN
guard, the accounting), the driver of its rounds (:mod:`strategies.drivers`: synchronous, asynchronous or
secure, chosen by the settings) and the loop of ``start``. Its :meth:`RunContext.state_dict` is a
checkpoint: the method's state, the selector's, the clock's, the driver's and each stage's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from fedmm import protocol
from fedmm.observers import Observers, RunObserver
from fedmm.protocol import ClientUpdate
from strategies.contract import Participants, model_index, steps_one_model
from strategies.drivers import driver_for
from strategies.evaluation import Conventions, EvaluateFn, FederatedEvaluation
from strategies.heterogeneity import LocalWork, VirtualClock
from strategies.ledger import ReplyLedger, RoundOutcome, RunFailed
from strategies.loop_log import MultiModelResult, log_end, log_round, log_start, log_summary
from strategies.privacy import Privacy
from strategies.selection import ClientSelector, SeededRosterSelector
from strategies.server_optimizer import ServerOptimizer
from strategies.stages import round_end_stages
from strategies.trust import ReferenceTrainer

#: Called after every round with (round, global arrays, result so far).
RoundEnd = Any


class RunContext:
    """The run of one method (module docstring).

    Parameters
    ----------
    method : Method
        The method it runs.
    selector, work, observers, optimizer
        See :class:`~strategies.base.FedmmStrategy`.
    conventions : Conventions
        Flower's record conventions and per-model evaluation.
    """

    def __init__(self, method: Any, selector: ClientSelector | None, work: LocalWork | None,
                 observers: Iterable[RunObserver], optimizer: ServerOptimizer | None, conventions: Conventions) -> None:
        self.method = method
        settings = method.settings
        #: Flower's record conventions and per-model evaluation.
        self.conventions = conventions
        # A strategy made in any Flower app sends no roster query (its ClientApp may have no
        # query handler); the fedmm app turns it on (build_strategy).
        self.selector = selector or SeededRosterSelector(method.seed, query=False)
        #: Virtual time and the clients' speeds (strategies/heterogeneity.py).
        self.clock = VirtualClock(settings.heterogeneity, method.seed, work)
        #: Replies accepted in the last round, and why the others were rejected.
        self.last_round = RoundOutcome()
        #: The train replies: the round's slots, accepted updates, rejections (strategies/ledger.py).
        self.replies = ReplyLedger(self.where)
        #: What sees the rounds (fedmm/observers.py).
        self.observers = observers if isinstance(observers, Observers) else Observers(observers)
        if optimizer is not None and not steps_one_model(type(method)):
            raise ValueError(f"{type(method).__name__} takes no server optimizer (it keeps several models, or evaluates "
                             "another model than the one it trains next)")
        #: The server optimizer (None: the method's own step).
        self.optimizer = optimizer
        #: Central differential privacy (strategies/privacy.py; None: off).
        self.privacy = Privacy.attach(self)
        #: The server's training on its root set for the trust stage (strategies/trust.py):
        #: (the model a node was sent, the round) -> the model trained from it; the runner sets it.
        self.reference: ReferenceTrainer | None = None
        #: The stages of every round's end, in order (strategies/stages.py).
        self.stages = round_end_stages(self)
        #: The driver of the rounds (strategies/drivers.py).
        self.driver = driver_for(type(method), settings)(self)
        #: Federated evaluation, the central evaluation of each round, the train metrics.
        self.evaluation = FederatedEvaluation(self)
        #: Why ``start`` ended before its last round at the caller's ``should_stop`` ("" when it did not).
        self.stopped = ""

    # ================================================================== what the drivers ask
    def participants(self, node_ids: list[int]) -> Participants:
        """The round's selected nodes as a method sees them (:class:`~strategies.base.Participants`)."""
        sizes = self.selector.all_num_examples() if isinstance(self.selector, SeededRosterSelector) else {}
        return Participants(list(node_ids), [self.selector.node_key(n) for n in node_ids], dict(sizes))

    def where(self, node: int, slot: int) -> str:
        """How log lines name a node: with the model index when the server keeps several models."""
        models = self.method.models
        several = models is not None and len(models) > 1
        return f"node {node}" + (f" (model {model_index(self.method, slot)})" if several else "")

    def train_config(self, server_round: int) -> dict[str, Any]:
        """What every train message of ``server_round`` carries besides the run's config: the
        measurements the method needs (``fedmm-measure``), the DP stage's entries."""
        measured = self.method.needs(server_round).measured
        return {**({protocol.MEASURE: measured} if measured else {}),
                **(self.privacy.train_config() if self.privacy is not None else {})}

    def send(self, grid: Grid, messages: list[Any], timeout: float, on_reply: Any = None) -> list[Any]:
        """One phase (:meth:`~strategies.evaluation.FederatedEvaluation.send`)."""
        return self.evaluation.send(grid, messages, timeout, on_reply)

    # ================================================================== state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run exactly: the method's state, the selector's, the
        clock's, the nodes' accepted rounds, the driver's and each stage's."""
        state = {**self.method.state_dict(), "selector": self.selector.state_dict(),
                 "accepted_rounds": dict(self.replies.accepted_rounds), "clock": self.clock.state_dict(),
                 **self.driver.state_dict()}
        return {**state, **{stage.key: stage.state_dict() for stage in self.stages if stage.key}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.method.load_state_dict(state)
        self.replies.spec = protocol.array_spec(self.method.models[0])
        self.selector.load_state_dict(state["selector"])
        self.replies.accepted_rounds = {int(k): int(v) for k, v in state.get("accepted_rounds", {}).items()}
        if "clock" in state:  # checkpoints before the virtual clock have none
            self.clock.load_state_dict(state["clock"])
        for stage in self.stages:
            if stage.key:
                stage.load_state_dict(state[stage.key])
        self.driver.load_state_dict(state)

    # ================================================================== the loop
    def log_summary(self) -> None:
        """The strategy's sampling, models, record keys and settings, and its driver's line."""
        log_summary(self)
        if self.driver.describe():
            log(INFO, "\t└──> %s", self.driver.describe())

    def start(  # noqa: PLR0913 - Flower's signature plus resume
        self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
        train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None, should_stop: Any = None, *, start_round: int = 1,
        round_end: RoundEnd | None = None, max_failed_rounds: int | None = None, final_report: bool = True,
        return_models: bool = True,
    ) -> MultiModelResult:
        """Run rounds ``start_round`` .. ``num_rounds``; logs as Flower's strategies do. With
        ``start_round > 1`` it goes on from its state (:meth:`load_state_dict`; ``initial_arrays``
        ignored). ``max_failed_rounds`` rounds in a row with no accepted reply raise :class:`RunFailed`.
        ``final_report``: log the whole :class:`Result`; ``return_models``: a copy of the server's
        models in :attr:`MultiModelResult.models`. ``should_stop(round, result)`` (Flower 1.43's
        callback): True after a round ends the run there (:attr:`stopped`, Flower's log line)."""
        method = self.method
        log_start(type(method).__name__, num_rounds, start_round, initial_arrays, train_config, evaluate_config)
        method.summary()
        self.observers.on_strategy_start(method)
        log(INFO, "")
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = MultiModelResult()
        t_start = time.time()
        if start_round <= 1:
            arrays = initial_arrays
            self.evaluation.evaluate_initial(arrays, evaluate_fn, result)
        else:
            if method.models is None or method.global_model is None:
                raise RuntimeError(f"start_round={start_round} needs the strategy's state: call context.load_state_dict first")
            arrays = result.arrays = protocol.model_to_record(method.global_model)
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
                raise RunFailed(self.last_round.why_failed(failed_rounds, current_round, max_failed_rounds))
            if agg_arrays is not None:
                result.arrays = arrays = agg_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[current_round] = train_metrics
            log_round(type(method).__name__, train_metrics, method.round_log)
            self.evaluation.evaluate_round(current_round, grid, arrays, evaluate_config, timeout, evaluate_fn, result)
            if round_end:
                round_end(current_round, arrays, result)
            self.observers.on_round_end(current_round)
            if should_stop is not None and should_stop(current_round, result):
                log(INFO, "Stopping early after round %s", current_round)  # Flower's own line
                self.stopped = f"should_stop returned True after round {current_round}"
                break
        if return_models:
            result.models = [protocol.model_to_record(m) for m in method.models or []]
        log_end(result, t_start, final_report)
        self.observers.on_strategy_end()
        return result

    def train_metrics(self, updates: list[ClientUpdate]) -> MetricRecord:
        """The round's aggregated train metrics (:meth:`~strategies.evaluation.FederatedEvaluation.train_metrics`)."""
        return self.evaluation.train_metrics(updates)


def build_strategy(run: Any, observers: Iterable[RunObserver] = ()) -> Any:
    """The strategy of a run (:class:`fedmm.config.RunSettings`): K from ``clients_per_round``,
    N, the seed, the method's settings (resolved for the run: ``StrategySettings.for_run``), the
    client selector of ``selection`` (the seeded roster by default, with the roster query, asking
    the nodes' sizes when the settings need them), the clock's work model, the server optimizer."""
    cls = run.strategy.strategy_class
    settings = run.strategy.for_run(run)
    selector = run.selection.build(run)
    if selector is None:
        query = {protocol.ROSTER_EXAMPLES: 1, protocol.RUN_CONFIG: protocol.run_config_record(run)} \
            if settings.needs_sizes else None
        selector = SeededRosterSelector(run.seed, query_config=query, min_nodes_timeout=float(run.min_nodes_timeout) or None)
    return cls(run.clients_per_round, run.seed, selector=selector, settings=settings, num_clients=run.num_clients,
               work=LocalWork.from_run(run), observers=observers, server_optimizer=run.server_optimizer.build())
