"""The settings every server method has (:class:`StrategySettings`); a method's own extend them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fedmm.errors import ConfigError
from fedmm.settings import Int, Nullable, Number, Settings, setting
from strategies.defence import ONE_MODEL, DefenceSettings, refuse
from strategies.heterogeneity import NEUTRAL, HeterogeneitySettings


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
    #: Defence settings that have no meaning for the method: {setting: why} (refused when set);
    #: ``refill`` unless the method keeps a model per node of the round (it declares ``{}``).
    refused_defences: ClassVar[dict[str, str]] = ONE_MODEL
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
        held_out = run.partition.local_test_fraction
        if self.fraction_evaluate > 0 and not held_out:
            raise ConfigError(
                "partition.local_test_fraction",
                held_out,
                f"a fraction > 0 when strategy.fraction_evaluate={self.fraction_evaluate} "
                "(clients evaluate on held-out rows of their own data, never on what they train on)",
            )
