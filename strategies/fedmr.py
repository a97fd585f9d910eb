"""FedMR: federated model recombination (Hu et al., KDD'24), with two-stage training.

Round r ≤ ``first_stage_rounds``: aggregate the K trained models (unweighted mean, as the
authors' code) and reset all K models to it. Afterwards: recombine layer-wise.
``partition_ratio`` x gives the "FedMR-p x" ablation; x = 1.0 is "Indep".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedmm.errors import ConfigError
from fedmm.protocol import ModelDict
from fedmm.settings import Bool, Choice, Int, MapOf, Nullable, Number, setting
from strategies.aggregation import mean_models
from strategies.method import ASYNC, SECURE, SYNC
from strategies.multimodel import MultiModel, MultiModelSettings
from strategies.recombination import GRANULARITIES, recombine, segments_for_ratio
from strategies.secure_recombination import SecureRecombination, SecureSettings
from strategies.selection import ClientSelector


@dataclass
class FedMRSettings(MultiModelSettings):
    """FedMR's settings (KDD'24 §4, two-stage training §4.3, FedMR-p x ablation)."""

    option = "fedmr"
    title = "FedMR"
    first_stage_rounds: int = setting(0, Int(min=0), "rounds of plain aggregation first (two-stage training)",
                                      paper="0 (CNN), 100 (ResNet-20, VGG-16)", label="first stage {}")
    first_stage_by_model: dict = setting({}, MapOf(Int(min=0), "a mapping of model names to rounds >= 0"),
                                         "first-stage rounds by model name, in place of first_stage_rounds for a "
                                         "listed model (one sweep over several models)",
                                         paper="{resnet20: 100, resnet20-preact: 100, vgg16: 100} (preset fedmr_paper)")
    granularity: str = setting("tensor", Choice(*GRANULARITIES), "tensor: each state_dict entry on its own (the authors' "
                               "code) | layer: whole modules move together", label="{} granularity")
    partition_ratio: float | None = setting(None, Nullable(Number(gt=0, le=1), "null (layer-wise) or a number in (0, 1]; 1.0 = Indep"),
                                            '"FedMR-p x": ceil(1/x) contiguous segments share one permutation; 1.0 = Indep')
    track_models: bool = setting(False, Bool(), "evaluate each of the K models too, every evaluated round "
                                 "(model_<i>_accuracy in metrics.jsonl; KDD Fig. 5 plots Indep's models)")
    secure: SecureSettings = setting(SecureSettings(), help="secure recombination: clients swap layers, sealed end to "
                                     "end, relayed by the server (docs/secure_recombination.md)")

    #: Declared after runs were made: the values that reproduce those runs.
    added = {"first_stage_by_model": {}, "track_models": False}
    #: The asynchronous FedMR was an option of its own: FedMR with the asynchronous driver.
    renamed = {"fedmr_async": {"asynchronous": {"enabled": True}}}

    @property
    def display(self) -> str:
        return ("Indep" + super().display[len(self.title):]) if self.partition_ratio == 1.0 else super().display

    @property
    def driver(self) -> str:
        """Secure recombination's phases when ``secure.enabled``, else the base's choice."""
        return SECURE if self.secure.enabled else super().driver

    def check_values(self, prefix: str) -> None:
        """Secure recombination exchanges layers among the clients of one synchronous round."""
        if self.secure.enabled and self.asynchronous.enabled:
            raise ConfigError(f"{prefix}secure.enabled", True, f"false with {prefix}asynchronous.enabled=true (secure "
                              "recombination exchanges layers among the clients of one synchronous round)")
        super().check_values(prefix)

    def for_run(self, run: Any) -> FedMRSettings:
        """FedMR's settings for a run, its first stage resolved for the run's model (``first_stage_by_model``)."""
        by_model = self.first_stage_by_model
        if run.model.name in by_model:
            return self.replace(first_stage_rounds=by_model[run.model.name])
        return self


class FedMR(MultiModel):
    """FedMR on the multi-model base: only :meth:`update_models` differs.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector
        See :class:`~strategies.multimodel.MultiModel`.
    first_stage_rounds : int
        Rounds of plain aggregation before recombination starts (two-stage training).
    granularity : str
        ``tensor`` (each state_dict entry, the authors' code) or ``layer`` (whole modules).
    partition_ratio : float or None
        x of "FedMR-p x": ⌈1/x⌉ contiguous segments share one permutation. None: every unit
        has its own permutation (FedMR proper); 1.0: whole models are shuffled ("Indep").
    secure : SecureRecombination, optional
        Clients exchange layers among themselves, sealed end to end, before upload (and/or
        before training), so that the server cannot tell who trained which layer: its settings
        become ``strategy.secure`` (default: those of ``settings``), and the rounds are its phases.
    """

    Settings = FedMRSettings
    drivers = (SYNC, ASYNC, SECURE)

    def __init__(self, clients_per_round: int | None = None, seed: int = 0, fraction_evaluate: float | None = None,
                 selector: ClientSelector | None = None, secure: SecureRecombination | None = None, **settings: Any) -> None:
        if secure is not None:  # a relay given as an object: its settings are the method's
            settings["secure"] = secure.settings()
        super().__init__(clients_per_round, seed, fraction_evaluate, selector, **settings)
        self.segments = segments_for_ratio(self.settings.partition_ratio)

    def models_to_evaluate(self) -> list[ModelDict] | None:
        """The K models, each evaluated beside the global model, when ``track_models`` is on."""
        return list(self.models) if self.settings.track_models and self.models else None

    def update_models(self, server_round: int, models: list[ModelDict], trained: list[int]) -> list[ModelDict]:
        """Stage 1: every model becomes the mean; stage 2: recombine."""
        if server_round <= self.settings.first_stage_rounds:
            aggregate = mean_models(models)
            return [aggregate] * len(models)
        return recombine(models, self.rng, self.settings.granularity, self.segments)
