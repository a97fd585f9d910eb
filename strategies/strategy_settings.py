"""The settings every server method has (:class:`StrategySettings`); a method's own extend them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fedmm.errors import ConfigError
from fedmm.settings import Int, Nullable, Number, Settings, paired_objectives, setting
from strategies.aggregators import check_chain
from strategies.defence import ONE_MODEL, DefenceSettings, refuse, refused_settings
from strategies.heterogeneity import NEUTRAL, HeterogeneitySettings
from strategies.privacy import OFF, PrivacySettings, check_privacy


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

    #: Declared after runs were made: the values that reproduce those runs.
    added = {"max_num_examples": None, "defence": {"clip_update_norm": None},
             "heterogeneity": NEUTRAL, "privacy": OFF}

    def updates_per_round(self, run: Any) -> int:
        """The updates the defence stage and the run's mean see per round when every node
        answers (an asynchronous method's B)."""
        return run.clients_per_round

    #: How errors name where :meth:`updates_per_round` comes from.
    updates_named: ClassVar[str] = "clients_per_round"

    def check_values(self, prefix: str) -> None:
        """What the method holds decides the defence settings it refuses
        (:func:`strategies.defence.refused_settings`); secure recombination needs a synchronous round."""
        method = getattr(type(self), "strategy_class", None)
        secure = getattr(self, "secure", None)
        secure_on = bool(secure is not None and secure.enabled)
        if secure_on and getattr(getattr(method, "Driver", None), "asynchronous", False):
            raise ConfigError(f"{prefix}secure.enabled", True, f"false with strategy={self.option} (secure recombination "
                              "exchanges layers among the clients of one synchronous round)")
        refuse(self.defence, refused_settings(getattr(method, "holds", ONE_MODEL), secure_on), self.option or type(self).__name__)

    def check(self, run: Any) -> None:
        """The objectives paired with this method (their ``server``) are its clients' only ones;
        clients evaluate on rows they never train on: fraction_evaluate > 0 needs a held-out part."""
        paired = paired_objectives(self.option)
        if paired and run.objective.name not in paired:
            raise ConfigError("objective", run.objective.name, f"{' or '.join(paired)} with strategy {self.option} "
                              "(its clients run its objective: the records and state it keeps)")
        check_chain(self.defence, self.updates_per_round(run), self.updates_named)
        check_privacy(self, run)
        held_out = run.partition.local_test_fraction
        if self.fraction_evaluate > 0 and not held_out:
            raise ConfigError(
                "partition.local_test_fraction",
                held_out,
                f"a fraction > 0 when strategy.fraction_evaluate={self.fraction_evaluate} "
                "(clients evaluate on held-out rows of their own data, never on what they train on)",
            )
