"""The settings every server method has (:class:`StrategySettings`); a method's own extend them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fedmm.errors import ConfigError
from fedmm.settings import Int, Nullable, Number, Settings, paired_objectives, setting
from strategies.aggregators import check_chain
from strategies.asynchronous import AsyncSettings, check_async
from strategies.contract import ASYNC, SYNC
from strategies.defence import DefenceSettings
from strategies.drivers import check_driver, needs_sizes
from strategies.heterogeneity import NEUTRAL, HeterogeneitySettings
from strategies.privacy import OFF, PrivacySettings


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
    fraction_evaluate: float = setting(0.0, Number(ge=0.0, le=1.0),
                                       "share of the connected nodes that evaluate the global model each round")
    max_num_examples: int | None = setting(None, Nullable(Int(min=1), "null (2**31 - 1) or an integer >= 1"),
                                           "the largest num-examples a train reply may report for a node whose size "
                                           "the roster did not report (a reply above the node's roster size is always "
                                           "rejected): bounds one client's share of an example-weighted mean")

    defence: DefenceSettings = setting(DefenceSettings(), help="optional defences against hostile updates "
                                       "(docs/defences.md)")
    heterogeneity: HeterogeneitySettings = setting(HeterogeneitySettings(), help="client speeds, availability and "
                                                   "deadlines on a virtual clock (docs/async.md)")
    privacy: PrivacySettings = setting(PrivacySettings(), help="central, client-level differential privacy "
                                       "(docs/privacy.md)")
    asynchronous: AsyncSettings = setting(AsyncSettings(), help="rounds without a barrier, for a method that declares "
                                          "the asynchronous driver (docs/async.md)")

    #: Declared after runs were made: the values that reproduce those runs.
    added = {"max_num_examples": None, "defence": {"clip_update_norm": None},
             "heterogeneity": NEUTRAL, "privacy": OFF, "asynchronous": AsyncSettings().to_dict()}
    #: The asynchronous driver's settings were a method's own before they were its (FedBuff, the
    #: asynchronous FedMR and FedCross): a run made then carries them here.
    retired = {key: (lambda value, key=key: {"asynchronous": {"enabled": True, key: value}})
               for key in ("buffer_size", "max_staleness", "concurrency")}

    def updates_per_round(self, run: Any) -> int:
        """The updates the defence stage and the run's mean see per round when every node
        answers (the asynchronous driver's B)."""
        if not self.asynchronous.enabled:
            return run.clients_per_round
        return self.asynchronous.buffer(self.strategy_class.holds, run.clients_per_round)

    @property
    def updates_named(self) -> str:
        """How errors name where :meth:`updates_per_round` comes from."""
        return "strategy.asynchronous.buffer_size" if self.asynchronous.enabled else "clients_per_round"

    @property
    def driver(self) -> str:
        """The driver these settings choose (:mod:`strategies.drivers`): the asynchronous one with
        ``asynchronous.enabled``, else the synchronous round (FedMR's secure recombination: its own)."""
        return ASYNC if self.asynchronous.enabled else SYNC

    @property
    def needs_sizes(self) -> bool:
        """Whether the roster query asks the nodes for their training-set sizes (the asynchronous
        driver times jobs from them on the virtual clock; a method may need them too)."""
        return needs_sizes(self)

    def for_run(self, run: Any) -> StrategySettings:
        """The settings for a run (default: as validated; a method may resolve a value for the
        run's model or dataset, e.g. FedMR's ``first_stage_by_model``)."""
        return self

    @property
    def display(self) -> str:
        """The title, with "(async)" when a method that runs synchronously by default does not."""
        default_async = type(self)().asynchronous.enabled
        return self.title + (" (async)" if self.asynchronous.enabled and not default_async else "")

    def check_values(self, prefix: str) -> None:
        """The driver the settings choose must be one the method declares (:mod:`strategies.drivers`)."""
        method = getattr(type(self), "strategy_class", None)
        if method is not None:
            check_driver(self, method, prefix)

    def check(self, run: Any) -> None:
        """The objectives paired with this method (their ``server``) are its clients' only ones;
        each stage of the round's end refuses what it cannot do for the method
        (:func:`strategies.stages.check_stages`); clients evaluate on rows they never train on:
        fraction_evaluate > 0 needs a held-out part."""
        from strategies.stages import check_stages

        paired = paired_objectives(self.option)
        if paired and run.objective.name not in paired:
            raise ConfigError("objective", run.objective.name, f"{' or '.join(paired)} with strategy {self.option} "
                              "(its clients run its objective: the records and state it keeps)")
        if self.asynchronous.enabled:
            check_async(self, run)
        check_chain(self.defence, self.updates_per_round(run), self.updates_named)
        check_stages(self, run)
        held_out = run.partition.local_test_fraction
        if self.fraction_evaluate > 0 and not held_out:
            raise ConfigError(
                "partition.local_test_fraction",
                held_out,
                f"a fraction > 0 when strategy.fraction_evaluate={self.fraction_evaluate} "
                "(clients evaluate on held-out rows of their own data, never on what they train on)",
            )
