"""FedGen (Zhu, Hong, Zhou, ICML 2021) on the one-model round loop: data-free knowledge
distillation through a server-trained generator of latent vectors.

Every round the server
1. collects the sampled clients' models and label histograms (``label-counts`` reply record);
2. trains the generator (:class:`fedmm.models.generator.Generator`) for
   ``ensemble_epochs`` Adam steps (in ``ensemble_epochs / n_teacher_iters`` loops of
   ``n_teacher_iters``, as the code): labels drawn uniformly from the "qualified" labels (some
   sampled client holds more than ``min_samples_per_label``), z = G(ε, y), loss =
   ``ensemble_alpha``·teacher + ``ensemble_eta``·diversity, the teachers being the uploaded
   models' classifiers weighted per label by the clients' label counts
   (:func:`~fedmm.models.generator.teacher_loss`, with both codes' broadcasting quirk);
3. aggregates the models as FedAvg;
4. sends the generator with the model from the next round on (``generator`` record; its bytes
   count in ``bytes_sent``). The clients' objective ``fedgen`` adds the generator's terms.

The generator's input ε has ``noise_dim`` entries, its output the model's latent size (the input
of the final linear classifier, read from the model's last 2-D weight): 84 for the authors' CIFAR
CNN (``lenet``), 512 for ``cnn``, 64 for ResNet-20, 4096 for VGG-16 (no table to get wrong).
``generator_loss_start`` / ``generator_loss_end`` (first and last step of the round) go into
``metrics.jsonl``.

Presets: ``fedgen`` (the FedMR authors' constants: new Adam every round, batch 128, noise 100,
full label histograms) and ``fedgen_original`` (the original: one Adam with ExponentialLR(0.98)
stepped per round, batch 32, noise 64, the clients' α/β decaying by 0.98 per round).
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.supercore import log

from fedmm import protocol
from fedmm.config import Choice, Int, MapOf, Nullable, Number
from fedmm.models.generator import Generator, classifier_of, diversity_loss, label_weights, teacher_loss
from fedmm.protocol import ClientUpdate, ModelDict
from strategies.fedavg import FedAvg
from strategies.selection import ClientSelector

#: Keys of the ``strategy`` config group of FedGen (conf/strategy/fedgen*.yaml).
CONFIG_SCHEMA = {
    "fraction_evaluate": Number(ge=0.0, le=1.0),
    "noise_dim": Int(min=1),
    "hidden_dim": Int(min=1),
    "ensemble_lr": Nullable(Number(gt=0), "null (the value for the dataset) or a learning rate > 0"),
    "ensemble_lr_by_dataset": MapOf(Number(gt=0), "a mapping of dataset names to learning rates"),
    "default_ensemble_lr": Number(gt=0),
    "weight_decay": Number(ge=0),
    "ensemble_epochs": Int(min=1),
    "n_teacher_iters": Int(min=1),
    "batch_size": Int(min=1),
    "ensemble_alpha": Number(ge=0),
    "ensemble_eta": Number(ge=0),
    "optimizer": Choice("per_round", "persistent"),
    "lr_decay": Number(gt=0, le=1),
    "min_samples_per_label": Int(min=0),
}


def check_config(values: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
    """The generator's terms need the clients' objective ``fedgen``."""
    from fedmm.errors import ConfigError

    if cfg["objective"]["name"] != "fedgen":
        raise ConfigError("objective", cfg["objective"]["name"], "fedgen with strategy fedgen (the clients use the generator)")
    if values["ensemble_epochs"] < values["n_teacher_iters"]:
        raise ConfigError("strategy.ensemble_epochs", values["ensemble_epochs"],
                          f">= strategy.n_teacher_iters={values['n_teacher_iters']}")


class FedGen(FedAvg):
    """FedGen's server.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector
        See :class:`~strategies.base.RoundLoopStrategy`.
    settings : mapping
        The ``strategy`` config group (keys of :data:`CONFIG_SCHEMA`), with ``ensemble_lr``
        resolved for the dataset.
    """

    def __init__(self, clients_per_round: int, seed: int, settings: Mapping[str, Any], fraction_evaluate: float = 0.0,
                 selector: ClientSelector | None = None) -> None:
        super().__init__(clients_per_round, seed, fraction_evaluate, selector)
        self.settings = dict(settings)
        self.generator: Generator | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._encoded_generator: Any = None
        self.num_classes = 0

    def initialize(self, initial: ModelDict) -> None:
        """The model, and a generator shaped for its classifier."""
        super().initialize(initial)
        self._build_generator(initial)
        if self.settings["optimizer"] == "persistent":
            self.optimizer = self._adam()
            self.scheduler = torch.optim.lr_scheduler.ExponentialLR(self.optimizer, gamma=self.settings["lr_decay"])

    def _build_generator(self, model: ModelDict) -> None:
        weight, _ = classifier_of(model)
        self.num_classes, latent = model[weight].shape
        with torch.random.fork_rng():  # the generator's init draws from its own seed only
            torch.manual_seed(int(self.seed) * 7919 + 17)
            self.generator = Generator(self.settings["noise_dim"], self.num_classes, latent, self.settings["hidden_dim"])

    def _adam(self) -> torch.optim.Optimizer:
        assert self.generator is not None
        return torch.optim.Adam(self.generator.parameters(), lr=self.settings["ensemble_lr"], betas=(0.9, 0.999),
                                eps=1e-8, weight_decay=self.settings["weight_decay"], amsgrad=False)

    def prepare_round(self, server_round: int, node_ids: list[int]) -> None:
        """Encode the generator once for the round (sent from round 2 on: round 1 is plain CE)."""
        assert self.generator is not None
        self._encoded_generator = None
        if server_round > 1:
            self._encoded_generator = protocol.model_to_record(
                {k: v.detach().cpu().numpy() for k, v in self.generator.state_dict().items()})

    def extra_records(self, server_round: int, slot: int) -> dict[str, Any]:
        """The generator, from round 2 on."""
        return {protocol.GENERATOR: self._encoded_generator} if self._encoded_generator is not None else {}

    def reply_extras(self, server_round: int) -> dict[str, protocol.ArraySpec]:
        """Every reply carries the client's label histogram."""
        return {protocol.LABEL_COUNTS: {protocol.LABEL_COUNTS: ((self.num_classes,), np.dtype(np.int64))}}

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> ModelDict | None:
        """Train the generator on the uploaded models, then FedAvg."""
        if not updates:
            return None
        counts = np.stack([u.extras[protocol.LABEL_COUNTS][protocol.LABEL_COUNTS] for u in updates])
        first, last = self.train_generator(server_round, [u.model for u in updates], counts)
        self.round_log.update({"generator_loss_start": first, "generator_loss_end": last})
        return super().aggregate(server_round, updates)

    def train_generator(self, server_round: int, models: list[ModelDict], counts: np.ndarray) -> tuple[float, float]:
        """The round's generator steps; (loss of the first step, loss of the last)."""
        assert self.generator is not None
        s = self.settings
        weights, qualified = label_weights(counts, s["min_samples_per_label"])
        if len(qualified) == 0:
            log(INFO, "round %d: no label with more than %d samples at any sampled client: generator not trained",
                server_round, s["min_samples_per_label"])
            return float("nan"), float("nan")
        heads = []
        for model in models:
            w, b = classifier_of(model)
            heads.append((torch.from_numpy(np.array(model[w], dtype=np.float32)), torch.from_numpy(np.array(model[b], dtype=np.float32))))
        w_t = torch.from_numpy(weights.astype(np.float32))
        labels_pool = torch.from_numpy(qualified)
        rng = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + server_round)
        optimizer = self.optimizer if s["optimizer"] == "persistent" else self._adam()
        self.generator.train()
        losses = []
        for _ in range(s["ensemble_epochs"] // s["n_teacher_iters"]):
            for _ in range(s["n_teacher_iters"]):
                optimizer.zero_grad()
                y = labels_pool[torch.randint(0, len(labels_pool), (s["batch_size"],), generator=rng)]
                z, eps = self.generator(y, generator=rng)
                loss = s["ensemble_alpha"] * teacher_loss(z, y, heads, w_t) + s["ensemble_eta"] * diversity_loss(z, eps)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
        if self.scheduler is not None:
            self.scheduler.step()
        return losses[0], losses[-1]

    def state_dict(self) -> dict[str, Any]:
        """Models, RNG, selector, the generator (and its optimizer when it persists)."""
        assert self.generator is not None
        return {
            **super().state_dict(),
            "generator": {k: v.detach().clone() for k, v in self.generator.state_dict().items()},
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "num_classes": self.num_classes,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self._build_generator(self.models[0])
        assert self.generator is not None
        self.generator.load_state_dict(state["generator"])
        if self.settings["optimizer"] == "persistent":
            self.optimizer = self._adam()
            self.scheduler = torch.optim.lr_scheduler.ExponentialLR(self.optimizer, gamma=self.settings["lr_decay"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])

    def summary(self) -> None:
        """Log the strategy's settings."""
        super().summary()
        s = self.settings
        log(INFO, "\t    generator: noise %d, hidden %d, %d Adam steps/round at lr %g (%s), batch %d",
            s["noise_dim"], s["hidden_dim"], s["ensemble_epochs"], s["ensemble_lr"], s["optimizer"], s["batch_size"])


def resolve_ensemble_lr(settings: Mapping[str, Any], dataset: str) -> float:
    """``ensemble_lr`` when set, else the value for the dataset, else the default."""
    if settings.get("ensemble_lr") is not None:
        return float(settings["ensemble_lr"])
    return float(settings.get("ensemble_lr_by_dataset", {}).get(dataset, settings["default_ensemble_lr"]))


def from_config(cfg: Mapping[str, Any]) -> FedGen:
    """Build FedGen from the resolved run config."""
    s = dict(cfg["strategy"])
    s["ensemble_lr"] = resolve_ensemble_lr(s, cfg["dataset"]["name"])
    return FedGen(clients_per_round=cfg["clients_per_round"], seed=cfg["seed"], settings=s,
                  fraction_evaluate=s["fraction_evaluate"])
