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

import copy

from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.supercore import log

from fedmm import protocol
from fedmm.errors import ConfigError
from fedmm.settings import Choice, Int, MapOf, Nullable, Number, setting
from fedmm.models.generator import Generator, classifier_of, diversity_loss, label_weights, teacher_loss
from fedmm.protocol import ClientUpdate, ModelDict
from objectives import fedgen as fedgen_client
from strategies.aggregators import Mean
from strategies.base import Participants
from strategies.fedavg import FedAvg, FedAvgSettings
from strategies.method import Needs, refused
from strategies.selection import ClientSelector

@dataclass
class FedGenSettings(FedAvgSettings):
    """FedGen's server: the generator and its training (Zhu, Hong, Zhou, ICML 2021); its clients
    run the ``fedgen`` objective (selected with the method)."""

    option = "fedgen"
    title = "FedGen"
    noise_dim: int = setting(100, Int(min=1), "generator noise width", paper="100 (the port); 64 for CIFAR (the original)")
    hidden_dim: int = setting(512, Int(min=1), "generator hidden width")
    ensemble_lr: float | None = setting(None, Nullable(Number(gt=0), "null (the value for the dataset) or a learning rate > 0"),
                                        "generator Adam lr; null: the value for the dataset below")
    ensemble_lr_by_dataset: dict = setting({"cifar10": 0.0003, "cifar100": 0.0001, "femnist": 0.0003},
                                           MapOf(Number(gt=0), "a mapping of dataset names to learning rates"),
                                           "generator lr per dataset")
    default_ensemble_lr: float = setting(0.0003, Number(gt=0), "generator lr for datasets not listed")
    weight_decay: float = setting(0.01, Number(ge=0), "generator Adam weight decay")
    ensemble_epochs: int = setting(50, Int(min=1), "generator steps per round, in ensemble_epochs / n_teacher_iters loops")
    n_teacher_iters: int = setting(5, Int(min=1), "inner loop of the generator steps")
    batch_size: int = setting(128, Int(min=1), "labels per generator step", paper="128 (the port); 32 (the original)")
    ensemble_alpha: float = setting(1.0, Number(ge=0), "teacher loss weight")
    ensemble_eta: float = setting(1.0, Number(ge=0), "diversity loss weight")
    optimizer: str = setting("per_round", Choice("per_round", "persistent"), "per_round: a new Adam every round (the "
                             "port) | persistent: one Adam + ExponentialLR (the original)")
    lr_decay: float = setting(0.98, Number(gt=0, le=1), "ExponentialLR gamma (persistent only)")
    min_samples_per_label: int = setting(1, Int(min=0), "a label is trained on when some sampled client holds more than this many")

    @property
    def display(self) -> str:
        return "FedGen (original)" if self.optimizer == "persistent" else super().display

    def for_run(self, run: Any) -> FedGenSettings:
        """FedGen's settings for a run, its generator's lr resolved for the dataset."""
        return self.replace(ensemble_lr=resolve_ensemble_lr(self, run.dataset.name))

    def check(self, run: Any) -> None:
        """The generator's terms need the clients' objective ``fedgen``."""
        super().check(run)
        if self.ensemble_epochs < self.n_teacher_iters:
            raise ConfigError("strategy.ensemble_epochs", self.ensemble_epochs, f">= strategy.n_teacher_iters={self.n_teacher_iters}")

class FedGen(FedAvg):
    """FedGen's server.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector
        See :class:`~strategies.base.FedmmStrategy`.
    settings : FedGenSettings
        With ``ensemble_lr`` resolved for the dataset (:meth:`FedGenSettings.for_run` does it).
    """

    Settings = FedGenSettings
    releases = refused("its generator is trained on each uploaded model and the clients' label counts, which are "
                       "released with it")

    def __init__(self, clients_per_round: int | None = None, seed: int = 0, fraction_evaluate: float | None = None,
                 selector: ClientSelector | None = None, **settings: Any) -> None:
        super().__init__(clients_per_round, seed, fraction_evaluate, selector, **settings)
        self.generator: Generator | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._encoded_generator: Any = None
        self.num_classes = 0

    def initialize(self, initial: ModelDict) -> None:
        """The model, and a generator shaped for its classifier."""
        super().initialize(initial)
        self._build_generator(initial)
        if self.settings.optimizer == "persistent":
            self.optimizer = self._adam()
            self.scheduler = torch.optim.lr_scheduler.ExponentialLR(self.optimizer, gamma=self.settings.lr_decay)

    def _build_generator(self, model: ModelDict) -> None:
        weight, _ = classifier_of(model)
        self.num_classes, latent = model[weight].shape
        with torch.random.fork_rng():  # the generator's init draws from its own seed only
            torch.manual_seed(int(self.seed) * 7919 + 17)
            self.generator = Generator(self.settings.noise_dim, self.num_classes, latent, self.settings.hidden_dim)

    def _adam(self) -> torch.optim.Optimizer:
        assert self.generator is not None
        return torch.optim.Adam(self.generator.parameters(), lr=self.settings.ensemble_lr, betas=(0.9, 0.999),
                                eps=1e-8, weight_decay=self.settings.weight_decay, amsgrad=False)

    def prepare_round(self, server_round: int, participants: Participants) -> None:
        """Encode the generator once for the round (sent from round 2 on: round 1 is plain CE)."""
        assert self.generator is not None
        self._encoded_generator = None
        if server_round > 1:
            self._encoded_generator = protocol.model_to_record(
                {k: v.detach().cpu().numpy() for k, v in self.generator.state_dict().items()})

    def extra_records(self, server_round: int, slot: int) -> dict[str, Any]:
        """The generator, from round 2 on."""
        return {fedgen_client.GENERATOR: self._encoded_generator} if self._encoded_generator is not None else {}

    def needs(self, server_round: int) -> Needs:
        """Every reply carries the client's label histogram."""
        return Needs(arrays={fedgen_client.LABEL_COUNTS: {fedgen_client.LABEL_COUNTS: ((self.num_classes,), np.dtype(np.int64))}})

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        """Train the generator on the uploaded models, then FedAvg."""
        if not updates:
            return None
        counts = np.stack([u.extras[fedgen_client.LABEL_COUNTS][fedgen_client.LABEL_COUNTS] for u in updates])
        first, last = self.train_generator(server_round, [u.model for u in updates], counts)
        self.round_log.update({"generator_loss_start": first, "generator_loss_end": last})
        return super().aggregate(server_round, updates, mean)

    def train_generator(self, server_round: int, models: list[ModelDict], counts: np.ndarray) -> tuple[float, float]:
        """The round's generator steps; (loss of the first step, loss of the last)."""
        assert self.generator is not None
        s = self.settings
        weights, qualified = label_weights(counts, s.min_samples_per_label)
        if len(qualified) == 0:
            log(INFO, "round %d: no label with more than %d samples at any sampled client: generator not trained",
                server_round, s.min_samples_per_label)
            return float("nan"), float("nan")
        heads = []
        for model in models:
            w, b = classifier_of(model)
            heads.append((torch.from_numpy(np.array(model[w], dtype=np.float32)), torch.from_numpy(np.array(model[b], dtype=np.float32))))
        w_t = torch.from_numpy(weights.astype(np.float32))
        labels_pool = torch.from_numpy(qualified)
        rng = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + server_round)
        optimizer = self.optimizer if s.optimizer == "persistent" else self._adam()
        self.generator.train()
        losses = []
        for _ in range(s.ensemble_epochs // s.n_teacher_iters):
            for _ in range(s.n_teacher_iters):
                optimizer.zero_grad()
                y = labels_pool[torch.randint(0, len(labels_pool), (s.batch_size,), generator=rng)]
                z, eps = self.generator(y, generator=rng)
                loss = s.ensemble_alpha * teacher_loss(z, y, heads, w_t) + s.ensemble_eta * diversity_loss(z, eps)
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
            # copies: the next round steps the optimizer in place, and an interrupt checkpoint
            # taken then must hold this round's state, not a mix of two
            "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
            "scheduler": copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None,
            "num_classes": self.num_classes,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self._build_generator(self.models[0])
        assert self.generator is not None
        self.generator.load_state_dict(state["generator"])
        if self.settings.optimizer == "persistent":
            self.optimizer = self._adam()
            self.scheduler = torch.optim.lr_scheduler.ExponentialLR(self.optimizer, gamma=self.settings.lr_decay)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])


def resolve_ensemble_lr(settings: FedGenSettings, dataset: str) -> float:
    """``ensemble_lr`` when set, else the value for the dataset, else the default."""
    if settings.ensemble_lr is not None:
        return float(settings.ensemble_lr)
    return float(settings.ensemble_lr_by_dataset.get(dataset, settings.default_ensemble_lr))
