"""FedGen's client (Zhu, Hong, Zhou, ICML 2021): the generator's terms in the local loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedmm.settings import Choice, Int, MapOf, Nullable, Number, setting
from fedmm.training import host_values, weighted_sum
from objectives.base import LocalUpdate, ObjectiveSettings, frozen

#: ArrayRecord of a FedGen train message (from round 2): the generator's state_dict.
GENERATOR = "generator"
#: ArrayRecord of a FedGen train reply: one int64 array of the client's label counts (same name).
LABEL_COUNTS = "label-counts"


@dataclass
class FedGenClientSettings(ObjectiveSettings):
    """The weights of the generator's terms (the FedMR port's values by dataset; the preset
    ``fedgen_original``: the original's decay, batch and label sampling)."""

    option = "fedgen"
    title = "FedGen"
    generative_alpha: float | None = setting(None, Nullable(Number(ge=0), "null (the value for the dataset) or a number >= 0"),
                                             "α of the generated-batch CE; null: the value for the dataset")
    generative_beta: float | None = setting(None, Nullable(Number(ge=0), "null (the value for the dataset) or a number >= 0"),
                                            "β of the KL term; null: the value for the dataset")
    alpha_by_dataset: dict = setting({"cifar10": 0.2, "cifar100": 10.0, "femnist": 10.0},
                                     MapOf(Number(ge=0), "a mapping of dataset names to numbers >= 0"), "α by dataset")
    beta_by_dataset: dict = setting({"cifar10": 0.2, "cifar100": 1.0, "femnist": 10.0},
                                    MapOf(Number(ge=0), "a mapping of dataset names to numbers >= 0"), "β by dataset")
    default_alpha: float = setting(0.2, Number(ge=0), "α for datasets not listed")
    default_beta: float = setting(0.2, Number(ge=0), "β for datasets not listed")
    decay: float = setting(1.0, Number(gt=0, le=1), "α, β × decay^(round−1), floored at 1e-4 (1.0: constant, the port; "
                           "0.98: the original)")
    gen_batch_size: int = setting(128, Int(min=1), "generated latents per batch", paper="128 (the port); 32 (the original)")
    sample_labels: str = setting("all", Choice("all", "available"), "labels of the generated batch: all classes (the "
                                 "port) | available (the client's, the original)")

    server = "fedgen"


class FedGenClient(LocalUpdate):
    """FedGen's client (Zhu, Hong, Zhou, ICML 2021). From round 2 on (round 1 is plain CE) the
    train message carries the server's generator G (frozen, eval mode); for each real batch
    (x, y), with h the local model's classifier (``classify``) and ε fresh uniform noise:

        L = CE(f(x), y) + β·KL(softmax(h(G(ε, y))) ‖ softmax(f(x))) + α·mean CE(h(G(ε, ŷ)), ŷ)

    where ŷ are ``gen_batch_size`` labels drawn uniformly from all classes (``sample_labels:
    all``, the FedMR port) or from the labels the client holds (``available``, the original),
    and α, β are ``generative_alpha`` / ``generative_beta`` (by dataset, as the FedMR port's
    table) times ``decay``^(round − 1), floored at 1e-4 (decay 1: constant, the port; 0.98: the
    original). The KL target is detached. The reply carries the client's label histogram
    (``label-counts``), which the server needs for the teachers' weights.
    """

    Settings = FedGenClientSettings

    def _weight(self, key: str, table: str, default: str, server_round: int) -> float:
        value = getattr(self.params, key)
        if value is None:
            value = getattr(self.params, table).get(self.run.dataset.name, getattr(self.params, default))
        return max(1e-4, float(value) * float(self.params.decay) ** (server_round - 1)) if value else 0.0

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Load the generator (from round 2); reset the label counts."""
        from fedmm import protocol  # here: the objectives import without Flower

        from fedmm.models.generator import Generator

        self.num_classes = int(self.run.dataset.num_classes)
        self.counts = torch.zeros(self.num_classes, dtype=torch.long)
        self.steps_seen = 0
        self.generator: nn.Module | None = None
        if GENERATOR in self.content:
            s = self.run.strategy
            gen = Generator(int(s.noise_dim), self.num_classes, int(model.latent_dim), int(s.hidden_dim))
            state = protocol.record_to_model(self.content[GENERATOR])
            gen.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
            self.generator = frozen(gen.to(next(model.parameters()).device))
        self.alpha = self._weight("generative_alpha", "alpha_by_dataset", "default_alpha", server_round)
        self.beta = self._weight("generative_beta", "beta_by_dataset", "default_beta", server_round)
        self.gen_batch = int(self.params.gen_batch_size)
        self._kl_terms: list[torch.Tensor] = []  # kept on the device, read once by metrics()
        self._gen_terms: list[torch.Tensor] = []

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.counts += torch.bincount(y.detach().cpu(), minlength=self.num_classes)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if self.generator is None:
            return loss, logits
        with torch.no_grad():
            z_y, _ = self.generator(y)
        target = F.softmax(model.classify(z_y), dim=1).detach()
        kl = F.kl_div(F.log_softmax(logits, dim=1), target, reduction="batchmean")
        if self.params.sample_labels == "available":
            held = torch.flatnonzero(self.counts > 0).to(y.device)
            y_hat = held[torch.randint(0, len(held), (self.gen_batch,), device=y.device)]
        else:
            y_hat = torch.randint(0, self.num_classes, (self.gen_batch,), device=y.device)
        with torch.no_grad():
            z_hat, _ = self.generator(y_hat)
        gen_ce = F.cross_entropy(model.classify(z_hat), y_hat)
        self._kl_terms.append(kl.detach())
        self._gen_terms.append(gen_ce.detach())
        return loss + self.beta * kl + self.alpha * gen_ce, logits

    def end(self, model: nn.Module) -> dict[str, Any]:
        """The label histogram: the labels of the batches seen, divided by the local epochs (every
        row is visited once per epoch, so this is the client's full histogram)."""
        from fedmm import protocol  # here: the objectives import without Flower

        epochs = max(1, int(self.run.training.local_epochs))
        counts = (self.counts // epochs).numpy().astype(np.int64)
        return {LABEL_COUNTS: protocol.model_to_record({LABEL_COUNTS: counts})}

    def metrics(self) -> dict[str, float]:
        """The generator terms' mean values of the round (0 in round 1)."""
        n = max(len(self._kl_terms), 1)
        return {"fedgen_kl": weighted_sum(host_values(self._kl_terms)) / n,
                "fedgen_ce": weighted_sum(host_values(self._gen_terms)) / n}
