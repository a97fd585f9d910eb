"""FedMR: federated model recombination (Hu et al., KDD'24), with two-stage training.

Round r ≤ ``first_stage_rounds``: aggregate the K trained models (unweighted mean, as the
authors' code) and reset all K models to it. Afterwards: recombine layer-wise.
``partition_ratio`` x gives the "FedMR-p x" ablation; x = 1.0 is "Indep".
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from typing import Any

from flwr.supercore import log

from fedmm.config import AnyValue, Choice, Int, Nullable, Number
from fedmm.protocol import ModelDict
from strategies.aggregation import mean_models
from strategies.multimodel import MultiModelStrategy
from strategies.recombination import GRANULARITIES, recombine, segments_for_ratio
from strategies.secure_recombination import SecureRecombination
from strategies.secure_recombination import check_config as check_secure
from strategies.selection import ClientSelector

#: Keys of the ``strategy`` config group of FedMR (defaults in conf/strategy/fedmr.yaml).
CONFIG_SCHEMA = {
    "fraction_evaluate": Number(ge=0.0, le=1.0),
    "first_stage_rounds": Int(min=0),
    "granularity": Choice(*GRANULARITIES),
    "partition_ratio": Nullable(Number(gt=0, le=1), "null (layer-wise) or a number in (0, 1]; 1.0 = Indep"),
    "secure": AnyValue(),  # checked by check_config (strategies.secure_recombination.CONFIG_SCHEMA)
}


def check_config(strategy: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
    """``strategy.secure``: its keys and values."""
    check_secure(strategy["secure"])


class FedMR(MultiModelStrategy):
    """FedMR on the multi-model base: only :meth:`update_models` differs.

    Parameters
    ----------
    num_models, seed, fraction_evaluate, selector
        See :class:`~strategies.multimodel.MultiModelStrategy`.
    first_stage_rounds : int
        Rounds of plain aggregation before recombination starts (two-stage training).
    granularity : str
        ``tensor`` (each state_dict entry, the authors' code) or ``layer`` (whole modules).
    partition_ratio : float or None
        x of "FedMR-p x": ⌈1/x⌉ contiguous segments share one permutation. None: every unit
        has its own permutation (FedMR proper); 1.0: whole models are shuffled ("Indep").
    secure : SecureRecombination, optional
        Clients exchange layers among themselves, sealed end to end, before upload (and/or
        before training), so that the server cannot tell who trained which layer.
    """

    def __init__(
        self,
        num_models: int,
        seed: int,
        fraction_evaluate: float = 0.0,
        first_stage_rounds: int = 0,
        granularity: str = "tensor",
        partition_ratio: float | None = None,
        selector: ClientSelector | None = None,
        secure: SecureRecombination | None = None,
    ) -> None:
        super().__init__(num_models, seed, fraction_evaluate, selector)
        self.first_stage_rounds = first_stage_rounds
        self.granularity = granularity
        self.segments = segments_for_ratio(partition_ratio)
        self.secure = secure

    def run_round(self, server_round, grid, arrays, config, timeout):  # type: ignore[no-untyped-def]
        """Plain FedMR: one train phase; with secure recombination, its phases
        (:class:`~strategies.secure_recombination.SecureRecombination`)."""
        if self.secure is None:
            return super().run_round(server_round, grid, arrays, config, timeout)
        return self.secure.run_round(self, server_round, grid, arrays, config, timeout)

    def update_models(self, server_round: int, models: list[ModelDict], trained: list[int]) -> list[ModelDict]:
        """Stage 1: every model becomes the mean; stage 2: recombine."""
        if server_round <= self.first_stage_rounds:
            aggregate = mean_models(models)
            return [aggregate] * self.num_models
        return recombine(models, self.rng, self.granularity, self.segments)

    def summary(self) -> None:
        """Log the strategy's settings."""
        super().summary()
        log(
            INFO,
            "\t    first_stage_rounds=%d granularity=%s segments=%s",
            self.first_stage_rounds,
            self.granularity,
            self.segments,
        )
        if self.secure is not None:
            log(INFO, "\t    %s", self.secure.describe())


def from_config(cfg: Mapping[str, Any]) -> FedMR:
    """Build FedMR from the resolved run config."""
    s = cfg["strategy"]
    return FedMR(
        num_models=cfg["clients_per_round"],
        seed=cfg["seed"],
        fraction_evaluate=s["fraction_evaluate"],
        first_stage_rounds=s["first_stage_rounds"],
        granularity=s["granularity"],
        partition_ratio=s["partition_ratio"],
        secure=SecureRecombination.from_config(s["secure"]),
    )
