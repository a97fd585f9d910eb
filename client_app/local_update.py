"""Local-update plugins: what a client does in its round of local training, selected by config.

A plugin is a :class:`LocalUpdate` subclass registered in :data:`PLUGINS` under the
``objective.name`` it answers to; its hyperparameters live in ``conf/objective/<name>.yaml`` and
its schema in :attr:`LocalUpdate.schema`. The client chooses the plugin from the run config, so
any plugin combines with any server method (FedRL under FedMR works).

One plugin instance serves one train message. Through it a method can

- read extra records of the train message (``self.content``, e.g. a control variate);
- keep per-node state across rounds in Flower's ``Context.state`` (``self.state``, a
  ``RecordDict``). It lives in the node's memory: in simulation for the whole run, on a deployed
  SuperNode until the SuperNode process restarts (a restart, like a resumed run, starts it empty);
- define the loss of a batch (:meth:`LocalUpdate.loss`);
- replace the optimizer step (:meth:`LocalUpdate.step`: two passes, gradient correction);
- add records to the reply (:meth:`LocalUpdate.end`).

The training loop (:func:`client_app.training.train`) calls :meth:`begin` once with the model as
received, :meth:`step` for every batch, and :meth:`end` after the last one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedmm.config import Bool, Choice, Int, MapOf, Nullable, Number, register_schema
from fedmm.errors import ConfigError

if TYPE_CHECKING:  # Flower only for the defaults below: the plugins train without it
    from flwr.app import RecordDict


class LocalUpdate:
    """Plain cross-entropy SGD; the base every other plugin extends.

    Parameters
    ----------
    cfg : Mapping
        The run's resolved config (``objective``, ``dataset``, ... groups).
    state : RecordDict
        This node's ``Context.state``: kept across rounds, empty at the node's first round.
    content : RecordDict
        The train message's records (``arrays``, ``config`` and any extra ones).
    """

    name = "ce"
    #: Keys of this plugin's ``objective`` config group (besides ``name``).
    schema: dict[str, Any] = {}
    #: The node's identity across runs (its partition id in simulation; set by the ClientApp).
    node: int = 0

    def __init__(self, cfg: Mapping[str, Any], state: RecordDict | None = None, content: RecordDict | None = None) -> None:
        self.cfg = cfg
        self.params: Mapping[str, Any] = cfg.get("objective", {"name": "ce"})
        if state is None or content is None:
            from flwr.app import RecordDict
        self.state = state if state is not None else RecordDict()
        self.content = content if content is not None else RecordDict()

    # ------------------------------------------------------------------ hooks
    def begin(self, model: nn.Module, server_round: int) -> None:
        """Called once per round, before training, with the model as received."""

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to minimise, logits) for one batch."""
        logits = model(x)
        return F.cross_entropy(logits, y), logits

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on a batch; returns the batch loss. Override for two-pass steps
        (SAM) or gradient corrections (SCAFFOLD)."""
        optimizer.zero_grad(set_to_none=True)
        loss, _ = self.loss(model, x, y)
        loss.backward()
        optimizer.step()
        return loss

    def end(self, model: nn.Module) -> dict[str, Any]:
        """Extra records of the reply, by name (besides ``arrays`` and ``metrics``)."""
        return {}

    def metrics(self) -> dict[str, float]:
        """Further metrics of the reply (after :meth:`end`)."""
        return {}

    def own_state(self) -> None:
        """Empty ``self.state`` when it holds another experiment's entries: several experiments
        run on one Flower run (a sweep on one simulation) share the nodes' ``Context``, and a
        stateful plugin must not read a previous experiment's state. Call it at ``begin``."""
        from flwr.app import ConfigRecord

        from fedmm import protocol

        tag = hashlib.sha1(json.dumps(dict(self.cfg), sort_keys=True, default=str).encode()).hexdigest()
        held = self.state[protocol.STATE_EXPERIMENT]["id"] if protocol.STATE_EXPERIMENT in self.state else None
        if held != tag:
            for key in list(self.state.keys()):
                del self.state[key]
            self.state[protocol.STATE_EXPERIMENT] = ConfigRecord({"id": tag})

    def optimizer_args(self, training: Mapping[str, Any], lr: float) -> dict[str, float]:
        """Keyword arguments of the round's ``torch.optim.SGD`` (default: the ``training`` group's)."""
        return {"lr": lr, "momentum": float(training["momentum"]), "weight_decay": float(training["weight_decay"])}

    # ------------------------------------------------------------------ config
    @classmethod
    def check_config(cls, params: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
        """Rules across keys (run after the schema check)."""

    def mu(self) -> float:
        """μ of the objective: ``objective.mu``, or the paper's value for the dataset."""
        return resolve_mu(self.params, self.cfg["dataset"]["name"])


def resolve_mu(params: Mapping[str, Any], dataset: str) -> float:
    """``mu`` when set, else ``mu_by_dataset[dataset]``, else ``default_mu``."""
    if params.get("mu") is not None:
        return float(params["mu"])
    return float(params.get("mu_by_dataset", {}).get(dataset, params.get("default_mu", 0.0)))


#: The μ keys shared by FedProx and FedRL.
_MU_SCHEMA = {
    "mu": Nullable(Number(ge=0), "null (the paper's value for the dataset) or a number >= 0"),
    "mu_by_dataset": MapOf(Number(ge=0), "a mapping of dataset names to numbers >= 0"),
    "default_mu": Number(ge=0),
}


class FedProx(LocalUpdate):
    """CE + (μ/2)·‖w − w_global‖² over all trainable parameters (Li et al. 2020, Eq. 2)."""

    name = "fedprox"
    schema = dict(_MU_SCHEMA)

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Keep a detached copy of the received parameters."""
        self.global_params = [p.detach().clone() for p in model.parameters()]
        self._mu = self.mu()

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ce, logits = super().loss(model, x, y)
        if self._mu == 0.0:
            return ce, logits
        prox = sum(((p - g) ** 2).sum() for p, g in zip(model.parameters(), self.global_params))
        return ce + 0.5 * self._mu * prox, logits


class FedRL(LocalUpdate):
    """Review learning (Wang et al. 2024, Algorithm 1 and Eq. 3).

    loss = CE + (μ/2)·‖kr_m − kr_{i,m}‖₂, where kr_m is the output of the first m layers of the
    received model (frozen, in eval mode, never updated) and kr_{i,m} that of the local model on
    the same batch. The review depth m cycles through 1..M (M = the model's ``num_layers``):
    batch by batch starting at 1 every round (``advance: batch``, Algorithm 1), or one depth per
    round (``advance: round``).
    """

    name = "fedrl"
    schema = {**_MU_SCHEMA, "advance": Choice("batch", "round")}

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Freeze a copy of the received model; reset the review depth."""
        self.reference = copy.deepcopy(model).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)
        self.num_layers = int(model.num_layers)
        self.server_round = server_round
        self.batches_seen = 0
        self._mu = self.mu()

    def review_depth(self) -> int:
        """m for the next batch, in 1..M."""
        if self.params.get("advance", "batch") == "round":
            return (self.server_round - 1) % self.num_layers + 1
        return self.batches_seen % self.num_layers + 1

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.review_depth()
        self.batches_seen += 1
        # one pass through the local model gives both kr_{i,m} and the logits
        h, kr_local = x, None
        for depth, layer in enumerate(model.layers, start=1):
            h = layer(h)
            if depth == m:
                kr_local = h
        logits = h
        ce = F.cross_entropy(logits, y)
        if self._mu == 0.0:
            return ce, logits
        with torch.no_grad():
            kr_global = self.reference.forward_prefix(x, m)
        review = torch.linalg.vector_norm(kr_global - kr_local)
        return ce + 0.5 * self._mu * review, logits


def asam_perturbation(
    named: list[tuple[str, torch.Tensor, torch.Tensor | None]], rho: float, eta: float, adaptive: bool
) -> list[torch.Tensor | None]:
    """The (A)SAM ascent step e for each (name, weight, gradient) (Caldarola et al. 2022, as
    their code): T = |w| + η for tensors whose name contains "weight" (BatchNorm's γ too) when
    ``adaptive``, T = 1 otherwise (and for every tensor in SAM); n = ‖T⊙g‖₂ over all tensors
    together + 1e-16; e = ρ·T²⊙g / n. None where a tensor has no gradient."""
    scaled = []
    for name, w, g in named:
        if g is None:
            scaled.append(None)
            continue
        t = (w.detach().abs() + eta) if adaptive and "weight" in name else None
        scaled.append((t, g))
    sq = [((t * g) if t is not None else g).pow(2).sum() for t, g in (x for x in scaled if x is not None)]
    norm = torch.sqrt(torch.stack(sq).sum()) + 1e-16 if sq else torch.tensor(1.0)
    out: list[torch.Tensor | None] = []
    for item in scaled:
        if item is None:
            out.append(None)
            continue
        t, g = item
        out.append(rho * (t * t * g if t is not None else g) / norm)
    return out


class ASAM(LocalUpdate):
    """FedASAM / FedSAM's client step (Caldarola, Caputo, Ciccone, ECCV 2022): per batch, a
    forward-backward at w, the ascent e (:func:`asam_perturbation`), a second forward-backward on
    the same batch at w + e, w restored, then the base SGD step (momentum and weight decay act on
    the second gradient). BatchNorm statistics are updated by both passes, as the reference code
    does. The server is FedAvg."""

    name = "asam"
    schema = {"rho": Number(gt=0), "eta": Number(ge=0), "adaptive": Bool()}

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss, _ = self.loss(model, x, y)
        loss.backward()
        named = [(n, p, p.grad) for n, p in model.named_parameters() if p.requires_grad]
        shifts = asam_perturbation(named, float(self.params["rho"]), float(self.params["eta"]), bool(self.params["adaptive"]))
        with torch.no_grad():
            for (_, p, _), e in zip(named, shifts):
                if e is not None:
                    p.add_(e)
        optimizer.zero_grad(set_to_none=True)
        perturbed, _ = self.loss(model, x, y)
        perturbed.backward()
        with torch.no_grad():
            for (_, p, _), e in zip(named, shifts):
                if e is not None:
                    p.sub_(e)
        optimizer.step()
        return loss


def _require_strategy(params: Mapping[str, Any], cfg: Mapping[str, Any], strategy: str, method: str) -> None:
    """A client objective that only works with its own server method."""
    if cfg["strategy"]["name"] != strategy:
        raise ConfigError("objective", params["name"], f"an objective other than {params['name']} with strategy "
                          f"{cfg['strategy']['name']} ({method}'s clients need strategy={strategy})")


class Scaffold(LocalUpdate):
    """SCAFFOLD's client (Karimireddy et al., ICML 2020, Option II).

    The train message carries the server's control variate c (``control``: one array per
    trainable parameter); the node keeps its own c_i in ``Context.state`` (zeros at its first
    round, and again after a SuperNode restart, which is logged). Every optimizer step uses the
    corrected gradient g − c_i + c (with the ``scaffold`` record's data weight w_i: g − c_i + c/w_i),
    clipped to ``clip_norm`` when set. After training, with K the optimizer steps taken and η the
    learning rate of the round (``control_lr: used``) or the configured one (``initial``, as the
    authors' lab code): c_i⁺ = c_i − c + (x − y)/(K·η); the reply carries Δc_i = c_i⁺ − c_i
    (``control-delta``) besides the trained model y, and the node stores c_i⁺.

    ``momentum`` replaces ``training.momentum`` for SCAFFOLD: Option II assumes plain SGD, and
    with momentum β the displacement x − y is about 1/(1 − β) times larger than K·η times the
    mean corrected gradient, so c_i comes out about that much too large (2× at β = 0.5).
    """

    name = "scaffold"
    schema = {
        "momentum": Number(ge=0, lt=1),
        "clip_norm": Nullable(Number(gt=0), "null (no clipping) or a gradient norm > 0"),
        "control_lr": Choice("used", "initial"),
    }

    @classmethod
    def check_config(cls, params: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
        """The client needs the server's control variate: strategy scaffold."""
        _require_strategy(params, cfg, "scaffold", "SCAFFOLD")

    def optimizer_args(self, training: Mapping[str, Any], lr: float) -> dict[str, float]:
        """SGD with SCAFFOLD's own ``momentum``."""
        return {**super().optimizer_args(training, lr), "momentum": float(self.params["momentum"])}

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Read c and the stored c_i; keep x."""
        from fedmm import protocol

        self.own_state()
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        if protocol.CONTROL not in self.content:
            raise ValueError(f"the train message has no {protocol.CONTROL!r} record: run objective=scaffold with strategy=scaffold")
        c = protocol.record_to_model(self.content[protocol.CONTROL])
        if list(c) != self.names:
            raise ValueError(f"the control variate's keys {list(c)[:3]}... do not match the model's trainable parameters {self.names[:3]}...")
        if protocol.CONTROL_STATE in self.state:
            ci = protocol.record_to_model(self.state[protocol.CONTROL_STATE])
            age = int(self.state[protocol.CONTROL_AGE_STATE]["rounds"])
        else:
            ci = {n: np.zeros_like(v) for n, v in c.items()}
            age = 0
            if server_round > 1:
                logging.getLogger("flwr").info(
                    "SCAFFOLD: no c_i in this node's state at round %d: starting from zeros (its first "
                    "participation, or the SuperNode restarted and lost it)", server_round)
        weight = 1.0
        if protocol.CONTROL_CONFIG in self.content:
            weight = float(self.content[protocol.CONTROL_CONFIG][protocol.CONTROL_WEIGHT])
        device = next(model.parameters()).device
        self.c = {n: torch.from_numpy(np.array(v)).to(device) for n, v in c.items()}
        self.ci = {n: torch.from_numpy(np.array(v)).to(device) for n, v in ci.items()}
        self.correction = [self.c[n] / weight - self.ci[n] for n in self.names]
        self.x = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        self.age = age
        self.steps, self.lr_used = 0, None

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One SGD step on the corrected gradient."""
        optimizer.zero_grad(set_to_none=True)
        loss, _ = self.loss(model, x, y)
        loss.backward()
        params = [p for p in model.parameters() if p.requires_grad]
        for p, corr in zip(params, self.correction):
            if p.grad is None:
                p.grad = corr.clone()
            else:
                p.grad.add_(corr)
        if self.params.get("clip_norm"):
            torch.nn.utils.clip_grad_norm_(params, float(self.params["clip_norm"]))
        optimizer.step()
        self.steps += 1
        self.lr_used = float(optimizer.param_groups[0]["lr"])
        return loss

    def end(self, model: nn.Module) -> dict[str, Any]:
        """c_i⁺ into the node's state, Δc_i into the reply."""
        from flwr.app import MetricRecord

        from fedmm import protocol

        if self.steps == 0:
            raise ValueError("SCAFFOLD: no optimizer step was taken (no training data?)")
        lr = self.lr_used if self.params["control_lr"] == "used" else float(self.cfg["training"]["lr"])
        scale = 1.0 / (self.steps * lr)
        new, delta = {}, {}
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n not in self.x:
                    continue
                ci_new = self.ci[n] - self.c[n] + (self.x[n] - p.detach()) * scale
                new[n] = ci_new.cpu().numpy()
                delta[n] = (ci_new - self.ci[n]).cpu().numpy()
        self.state[protocol.CONTROL_STATE] = protocol.model_to_record(new)
        self.state[protocol.CONTROL_AGE_STATE] = MetricRecord({"rounds": self.age + 1})
        return {protocol.CONTROL_DELTA: protocol.model_to_record(delta)}

    def metrics(self) -> dict[str, float]:
        """How many rounds this node's c_i has been trained for (1: first, or state lost)."""
        from fedmm import protocol

        return {protocol.CONTROL_AGE: float(self.age + 1)}


def contrastive_loss(z: torch.Tensor, z_global: torch.Tensor, z_negatives: list[torch.Tensor], tau: float) -> torch.Tensor:
    """MOON's ℓ_con, batch mean: −log(e^{sim(z,z_g)/τ} / (e^{sim(z,z_g)/τ} + Σ_p e^{sim(z,z_p)/τ})) with
    sim the cosine similarity, computed as the original: cross-entropy over the logits
    [sim(z, z_g), sim(z, z_p1), ...]/τ with target 0 (exactly 0 without a negative)."""
    logits = [F.cosine_similarity(z, z_global, dim=-1)] + [F.cosine_similarity(z, zp, dim=-1) for zp in z_negatives]
    logits = torch.stack(logits, dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


class Moon(LocalUpdate):
    """MOON's client (Li, He, Song, CVPR 2021): CE + μ·ℓ_con on the model's representation (the
    projection head's output when ``projection_dim`` is set, which puts the head into the model:
    ``model.projection_dim``; else the input of the classifier, as FL-bench).

    The positive is the received global model, the negative the model this node finished with
    the last round it took part (kept in ``Context.state``, replaced after each participation);
    both run frozen in eval mode. Without a previous model: ``first_negative: none`` uses no
    negative (ℓ_con = 0, plain CE), ``init`` the node's own untouched initial network (from round
    2 on; round 1 has none, as the original, where a party that never trained contributes its
    random initialisation), ``global`` the received model (ℓ_con = log 2, no gradient, as FL-bench).
    A SuperNode restart loses the previous model (logged; the node continues as at its first
    participation).
    """

    name = "moon"
    schema = {
        **_MU_SCHEMA,
        "tau": Number(gt=0),
        "projection_dim": Nullable(Int(min=1), "null (the classifier's input is the representation) or an integer >= 1"),
        "first_negative": Choice("none", "init", "global"),
    }

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Freeze a copy of the received model and the negative."""
        from fedmm import protocol

        self.own_state()
        self._mu = self.mu()
        self.tau = float(self.params["tau"])
        self.global_model = _frozen(copy.deepcopy(model))
        self.negative: nn.Module | None = None
        self.had_previous = protocol.MOON_PREVIOUS in self.state
        if self.had_previous:
            self.negative = _frozen(copy.deepcopy(model))
            previous = protocol.record_to_model(self.state[protocol.MOON_PREVIOUS])
            self.negative.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in previous.items()})
        else:
            if server_round > 1:
                logging.getLogger("flwr").info(
                    "MOON: no previous model in this node's state at round %d (its first participation, or the "
                    "SuperNode restarted and lost it): first_negative=%s", server_round, self.params["first_negative"])
            mode = self.params["first_negative"]
            if mode == "global":
                self.negative = self.global_model
            elif mode == "init" and server_round > 1:
                self.negative = _frozen(self._initial_network(model))
        self.age = int(self.state[protocol.MOON_AGE_STATE]["rounds"]) if protocol.MOON_AGE_STATE in self.state else 0
        self._con_sum, self._batches = 0.0, 0

    def _initial_network(self, model: nn.Module) -> nn.Module:
        """This node's own random initialisation (seeded by the run seed and the node)."""
        net = copy.deepcopy(model)
        generator_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(hash((int(self.cfg.get("seed", 0)), 0x300, self.node)) % (2**63))
            for module in net.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        finally:
            torch.random.set_rng_state(generator_state)
        return net

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = model.latent(x)
        logits = model.classify(z)
        ce = F.cross_entropy(logits, y)
        if self._mu == 0.0:
            return ce, logits
        with torch.no_grad():
            z_global = self.global_model.latent(x)
            negatives = [self.negative.latent(x)] if self.negative is not None else []
        con = contrastive_loss(z, z_global, negatives, self.tau)
        self._con_sum += float(con.detach())
        self._batches += 1
        return ce + self._mu * con, logits

    def end(self, model: nn.Module) -> dict[str, Any]:
        """Keep the trained model as this node's next negative."""
        from flwr.app import MetricRecord

        from fedmm import protocol

        self.state[protocol.MOON_PREVIOUS] = protocol.model_to_record(
            {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()})
        self.state[protocol.MOON_AGE_STATE] = MetricRecord({"rounds": self.age + 1})
        return {}

    def metrics(self) -> dict[str, float]:
        """The mean contrastive loss, and how many rounds this node has kept a previous model."""
        from fedmm import protocol

        return {protocol.MOON_CONTRASTIVE: self._con_sum / max(self._batches, 1), protocol.MOON_AGE: float(self.age + 1)}


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

    name = "fedgen"
    schema = {
        "generative_alpha": Nullable(Number(ge=0), "null (the value for the dataset) or a number >= 0"),
        "generative_beta": Nullable(Number(ge=0), "null (the value for the dataset) or a number >= 0"),
        "alpha_by_dataset": MapOf(Number(ge=0), "a mapping of dataset names to numbers >= 0"),
        "beta_by_dataset": MapOf(Number(ge=0), "a mapping of dataset names to numbers >= 0"),
        "default_alpha": Number(ge=0),
        "default_beta": Number(ge=0),
        "decay": Number(gt=0, le=1),
        "gen_batch_size": Int(min=1),
        "sample_labels": Choice("all", "available"),
    }

    @classmethod
    def check_config(cls, params: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
        """The client needs the server's generator: strategy fedgen."""
        _require_strategy(params, cfg, "fedgen", "FedGen")

    def _weight(self, key: str, table: str, default: str, server_round: int) -> float:
        value = self.params.get(key)
        if value is None:
            value = self.params.get(table, {}).get(self.cfg["dataset"]["name"], self.params[default])
        return max(1e-4, float(value) * float(self.params["decay"]) ** (server_round - 1)) if value else 0.0

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Load the generator (from round 2); reset the label counts."""
        from fedmm import protocol
        from fedmm.models.generator import Generator

        self.num_classes = int(self.cfg["dataset"]["num_classes"])
        self.counts = torch.zeros(self.num_classes, dtype=torch.long)
        self.steps_seen = 0
        self.generator: nn.Module | None = None
        if protocol.GENERATOR in self.content:
            s = self.cfg["strategy"]
            gen = Generator(int(s["noise_dim"]), self.num_classes, int(model.latent_dim), int(s["hidden_dim"]))
            state = protocol.record_to_model(self.content[protocol.GENERATOR])
            gen.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
            self.generator = _frozen(gen.to(next(model.parameters()).device))
        self.alpha = self._weight("generative_alpha", "alpha_by_dataset", "default_alpha", server_round)
        self.beta = self._weight("generative_beta", "beta_by_dataset", "default_beta", server_round)
        self.gen_batch = int(self.params["gen_batch_size"])
        self._kl_sum = self._gen_sum = 0.0
        self._batches = 0

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
        if self.params["sample_labels"] == "available":
            held = torch.flatnonzero(self.counts > 0).to(y.device)
            y_hat = held[torch.randint(0, len(held), (self.gen_batch,), device=y.device)]
        else:
            y_hat = torch.randint(0, self.num_classes, (self.gen_batch,), device=y.device)
        with torch.no_grad():
            z_hat, _ = self.generator(y_hat)
        gen_ce = F.cross_entropy(model.classify(z_hat), y_hat)
        self._kl_sum += float(kl.detach())
        self._gen_sum += float(gen_ce.detach())
        self._batches += 1
        return loss + self.beta * kl + self.alpha * gen_ce, logits

    def end(self, model: nn.Module) -> dict[str, Any]:
        """The label histogram: the labels of the batches seen, divided by the local epochs (every
        row is visited once per epoch, so this is the client's full histogram)."""
        from fedmm import protocol

        epochs = max(1, int(self.cfg["training"]["local_epochs"]))
        counts = (self.counts // epochs).numpy().astype(np.int64)
        return {protocol.LABEL_COUNTS: protocol.model_to_record({protocol.LABEL_COUNTS: counts})}

    def metrics(self) -> dict[str, float]:
        """The generator terms' mean values of the round (0 in round 1)."""
        n = max(self._batches, 1)
        return {"fedgen_kl": self._kl_sum / n, "fedgen_ce": self._gen_sum / n}


def _frozen(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


#: objective.name -> plugin class
PLUGINS: dict[str, type[LocalUpdate]] = {cls.name: cls for cls in (LocalUpdate, FedProx, FedRL, ASAM, Scaffold, Moon, FedGenClient)}

for _cls in PLUGINS.values():
    register_schema("objective", _cls.name, _cls.schema, _cls.check_config)


def build_local_update(
    cfg: Mapping[str, Any], state: RecordDict | None = None, content: RecordDict | None = None
) -> LocalUpdate:
    """The plugin named by ``objective.name`` (default ``ce``)."""
    name = cfg.get("objective", {}).get("name", "ce")
    if name not in PLUGINS:
        raise ConfigError("objective.name", name, ", ".join(PLUGINS))
    return PLUGINS[name](cfg, state, content)
