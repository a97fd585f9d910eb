"""Client objectives: what a client does in its round of local training, selected by config.

An objective is a :class:`LocalUpdate` subclass with a ``Settings`` declaration
(:class:`ObjectiveSettings`) in a module of this package, or of any package named by a
``fedmm.objective`` entry point; ``objective.name`` selects it, nothing lists it. The client
chooses the objective from the run config, so any objective combines with any server method
(FedRL under FedMR works).

One instance serves one train message. Through it a method can

- read extra records of the train message (``self.content``, e.g. a control variate) and the
  rows it trains on this round (``self.data``, set before :meth:`LocalUpdate.begin` on both
  training paths; :meth:`LocalUpdate.label_counts`: its class histogram, what a calibrated loss
  needs: FedLC, FedRS);
- keep per-node state across rounds in Flower's ``Context.state`` (``self.state``, a
  ``RecordDict``). It lives in the node's memory: in simulation for the whole run, on a deployed
  SuperNode until the SuperNode process restarts (a restart, like a resumed run, starts it empty);
- define the loss of a batch (:meth:`LocalUpdate.batch_loss`; :meth:`LocalUpdate.loss` for a
  loss that reads the model its own way) and change its gradient (:meth:`LocalUpdate.correct_gradient`,
  :meth:`LocalUpdate.gradient_clip`; :meth:`LocalUpdate.gradient` for two passes, SAM);
- add records to the reply (:meth:`LocalUpdate.end`) and metrics (:meth:`LocalUpdate.metrics`).

The optimizer step is the training loop's, the same on both paths, done once: the gradient
(:meth:`~LocalUpdate.gradient`), its correction, the objective's clipping, ``training.clip_grad_norm``,
then SGD; the loop counts the steps and tells the objective (:meth:`~LocalUpdate.finish_steps`).

An objective has one loss definition. :meth:`LocalUpdate.batch_loss` (with a gradient change, if
any, in :meth:`LocalUpdate.correct_gradient`) serves both training paths: the in-process engine
then trains a round's clients of it as one computation (:mod:`client_app.vectorized`) through the
same two methods, with each client's own tensors (:meth:`LocalUpdate.tensors`) stacked. An
objective that reads the model its own way overrides :meth:`LocalUpdate.loss` instead (or
:meth:`LocalUpdate.gradient`, for two passes): it trains one client at a time, always. Nothing
is declared: :meth:`LocalUpdate.vectorizable` derives it from what the class defines, and a class
that defines both ``loss`` and ``batch_loss`` is refused when it is made.

The training loop (:func:`client_app.training.train_epochs`, and the vectorized one) calls
:meth:`start` once with the model as received and the rows it trains on (which calls
:meth:`begin`), :meth:`gradient` for every batch (then steps), :meth:`finish_steps` after the
last, and the ClientApp calls :meth:`end`.

This package is the client's half of a method: the ClientApp imports it to train; the ServerApp
only to validate the ``objective`` group (it never calls it). It imports nothing of either app.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedmm.errors import ConfigError
from fedmm.settings import AnyValue, MapOf, Nullable, Number, Settings, discover, plain, setting

if TYPE_CHECKING:  # Flower only for the defaults below: the objectives train without it
    from flwr.app import RecordDict

    from fedmm.config import RunSettings
    from fedmm.data import TensorData
    from fedmm.training import TrainingSettings


@dataclass
class ObjectiveSettings(Settings):
    """Settings every client objective has; an objective's declaration extends this one."""

    group = "objective"
    #: The server method this objective's clients need (its records, its state; "" for any):
    #: declared here once, the pairing both ways is derived from it (a run with this objective
    #: and another strategy is refused, the strategy selects this objective and refuses others).
    server: ClassVar[str] = ""
    training: dict = setting({}, MapOf(AnyValue(), "a mapping of training-group keys to values"),
                             "training settings this objective's clients use in place of the training group's "
                             "(an original code's client: SCAFFOLD's lab code decays lr per round, FedExP's takes 20 steps)")

    #: Declared after runs were made: the value that reproduces those runs.
    added = {"training": {}}

    def check(self, run: Any) -> None:
        """An objective paired with a server method (``server``) runs under that method only."""
        if self.server and run.strategy.name != self.server:
            raise ConfigError("objective", self.option, f"an objective other than {self.option} with strategy "
                              f"{run.strategy.name} ({self.title or self.option}'s clients need strategy={self.server})")

    def check_values(self, prefix: str) -> None:
        from fedmm.training import TrainingSettings

        for key in self.training:
            if key not in TrainingSettings.__dataclass_fields__ or key == "device":
                allowed = ", ".join(f.name for f in TrainingSettings.settings_fields() if f.name != "device")
                raise ConfigError(f"{prefix}training.{key}", self.training[key], f"keys of the training group: {allowed}")
        TrainingSettings.from_dict({**TrainingSettings().to_dict(), **self.training}, f"{prefix}training.")


@dataclass
class CESettings(ObjectiveSettings):
    """Plain cross-entropy."""

    option = "ce"
    title = ""

class LocalUpdate:
    """Plain cross-entropy SGD; the base every other plugin extends.

    Parameters
    ----------
    run : RunSettings
        The run's settings (``run.objective``, ``run.dataset``, ...; a plain config mapping is
        read into settings).
    state : RecordDict
        This node's ``Context.state``: kept across rounds, empty at the node's first round.
    content : RecordDict
        The train message's records (``arrays``, ``config`` and any extra ones).
    """

    #: The objective's settings declaration.
    Settings: ClassVar[type[ObjectiveSettings]] = CESettings
    #: The node's identity across runs (its partition id in simulation; set by the ClientApp).
    node: int = 0
    #: The rows the client trains on this round (set by :meth:`start`, before :meth:`begin`).
    data: TensorData | None = None
    #: Batches this round's loss has been computed on (the index of the next one).
    batches_seen: int = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Settings" in cls.__dict__:  # the declaration knows what it builds
            cls.Settings.objective_class = cls
        if "loss" in cls.__dict__ and "batch_loss" in cls.__dict__:
            raise TypeError(f"{cls.__name__} defines both loss and batch_loss: one loss definition per objective "
                            "(batch_loss: both training paths; loss: a loss that reads the model its own way, one "
                            "client at a time)")
        if "vectorized" in cls.__dict__:
            raise TypeError(f"{cls.__name__}.vectorized: nothing to declare, it is derived from what the objective "
                            "defines (LocalUpdate.vectorizable)")

    @classmethod
    def vectorizable(cls) -> str:
        """Why the objective's clients cannot train as one computation ("" when they can): it
        overrides :meth:`loss` or :meth:`gradient` (its loss or step reads the model its own way)."""
        own = [name for name in ("loss", "gradient") if getattr(cls, name) is not getattr(LocalUpdate, name)]
        return f"it defines {' and '.join(own)} (one client at a time)" if own else ""

    def __init__(self, run: RunSettings | Mapping[str, Any], state: RecordDict | None = None, content: RecordDict | None = None) -> None:
        #: The run's settings (every group; the strategy's as sent by the server).
        self.run = as_client_run(run)
        values = self.run.objective
        #: This objective's settings (``objective`` group).
        self.params = values if isinstance(values, self.Settings) else self.Settings.from_dict(values.to_dict(), "objective.")
        if state is None or content is None:
            from flwr.app import RecordDict
        self.state = state if state is not None else RecordDict()
        self.content = content if content is not None else RecordDict()
        self._settle_kept()

    # ------------------------------------------------------------------ hooks
    def start(self, model: nn.Module, data: TensorData, server_round: int) -> None:
        """The training loop's call before the first step (both paths): ``self.data`` becomes the
        rows the client trains on, then :meth:`begin`."""
        self.data = data
        self.begin(model, server_round)

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Called once per round, before training, with the model as received (``self.data``: the
        rows it trains on)."""

    def label_counts(self) -> torch.Tensor:
        """How many rows of each class the client trains on this round (int64, one entry per class
        of the dataset): the data summary a calibrated loss reads (FedLC, FedRS)."""
        from fedmm.data import input_spec

        if self.data is None:
            raise RuntimeError("label_counts() is known from start() on (the training loop sets the rows first)")
        return torch.bincount(self.data.y.reshape(-1).cpu(), minlength=input_spec(self.run.dataset).num_classes)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to minimise, logits) for one batch: :meth:`batch_loss` with the model's own
        weights and this client's :meth:`tensors`."""
        index = self.batches_seen
        self.batches_seen = index + 1
        return self.batch_loss(model, None, self.tensors(), x, y, index)

    def gradient(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's gradient into the parameters' ``.grad`` (cleared before the call); returns
        the batch loss. One backward pass of :meth:`loss`; override for two passes (SAM). A
        change of the gradient (SCAFFOLD's correction) is :meth:`correct_gradient`; the step is
        the loop's."""
        loss, _ = self.loss(model, x, y)
        loss.backward()
        return loss

    # ------------------------------------------------------------------ the loss, once for both paths
    def tensors(self) -> dict[str, torch.Tensor]:
        """This client's own tensors that :meth:`batch_loss` and :meth:`correct_gradient` read
        (set up by :meth:`begin`; e.g. FedProx's received weights), by name. When a round's
        clients train together, each name is stacked across them."""
        return {}

    def batch_loss(self, model: nn.Module, weights: Mapping[str, torch.Tensor] | None, tensors: Mapping[str, torch.Tensor],
                   x: torch.Tensor, y: torch.Tensor, index: int, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to minimise, logits) of the client's batch number ``index`` (0 first, in the round).

        ``weights``: None to run ``model`` with its own parameters and buffers, else one client's
        (parameters and buffers by name: the clients trained together, ``model`` giving only the
        architecture; use :func:`call`, :func:`call_layers`, :func:`parameters`). ``tensors``:
        this client's :meth:`tensors`. ``rows``: None, or a 1/0 weight per row of ``x`` when the
        batch was padded to the size of other clients' (a model with no BatchNorm or dropout):
        a row of weight 0 must not reach the loss (:func:`mean_over_rows`). Plain cross-entropy here."""
        logits = call(model, weights, x)
        return cross_entropy(logits, y, rows), logits

    def correct_gradient(self, grads: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gradient the optimizer steps with, from the loss's ``grads`` (trainable parameters
        by name; one client's); unchanged here."""
        return grads

    def gradient_clip(self) -> float | None:
        """A norm this objective clips each client's (corrected) gradient to before the
        optimizer step (before ``training.clip_grad_norm``); None: none."""
        return None

    def finish_steps(self, steps: int, lr: float) -> None:
        """Told by the training loop, after the last batch, how many optimizer steps this client
        took and with what learning rate (both paths)."""

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

        from fedmm.protocol import STATE_EXPERIMENT

        tag = hashlib.sha1(json.dumps(plain(self.run), sort_keys=True, default=str).encode()).hexdigest()
        held = self.state[STATE_EXPERIMENT]["id"] if STATE_EXPERIMENT in self.state else None
        if held != tag:
            for key in list(self.state.keys()):
                del self.state[key]
            self.state[STATE_EXPERIMENT] = ConfigRecord({"id": tag})

    def local_training(self, training: TrainingSettings) -> TrainingSettings:
        """The training settings of this node's round: the training group's, with this
        objective's own ``training`` overrides."""
        return training.replace(**self.params.training) if self.params.training else training

    # ------------------------------------------------------------------ state kept across rounds
    def _config_value(self, key: str) -> Any:
        from fedmm.protocol import CONFIG

        try:
            return self.content[CONFIG][key] if CONFIG in self.content and key in self.content[CONFIG] else None
        except (KeyError, TypeError):
            return None

    def keep(self, records: Mapping[str, Any]) -> None:
        """Store ``records`` in the node's state for its next round, once the server has
        accepted this round's reply: they wait under a pending key, and the node's next train
        message says whether the server accepted it (its ``accepted-round``); a rejected
        round's state is dropped, so the node's state stays what the server counted (SCAFFOLD:
        c = mean(c_i)). With a server that does not say (a plain Flower strategy) or without a
        train message (secure recombination's training), they are kept at once."""
        from flwr.app import ConfigRecord

        from fedmm.protocol import SERVER_ROUND, STATE_PENDING

        server_round = self._config_value(SERVER_ROUND)
        if server_round is None or self._config_value("accepted-round") is None:
            for key, record in records.items():
                self.state[key] = record
            return
        for key, record in records.items():
            self.state[f"{STATE_PENDING}/{key}"] = record
        self.state[STATE_PENDING] = ConfigRecord({"round": int(server_round), "keys": list(records)})

    def _settle_kept(self) -> None:
        """Commit or drop the state :meth:`keep` left pending, by this message's ``accepted-round``."""
        if not self.state:  # nothing kept (and no Flower import: the objectives train without it)
            return
        from fedmm.protocol import ACCEPTED_ROUND, STATE_PENDING

        if STATE_PENDING not in self.state:
            return
        meta = self.state[STATE_PENDING]
        accepted = self._config_value(ACCEPTED_ROUND)
        commit = accepted is None or int(accepted) >= int(meta["round"])
        for key in list(meta["keys"]):
            pending = f"{STATE_PENDING}/{key}"
            if pending in self.state:
                if commit:
                    self.state[key] = self.state[pending]
                del self.state[pending]
        del self.state[STATE_PENDING]

    def optimizer_args(self, training: TrainingSettings, lr: float) -> dict[str, float]:
        """Keyword arguments of the round's ``torch.optim.SGD`` (default: the ``training`` group's)."""
        return {"lr": lr, "momentum": float(training.momentum), "weight_decay": float(training.weight_decay)}

    def mu(self) -> float:
        """μ of the objective: ``objective.mu``, or the paper's value for the dataset."""
        return resolve_mu(self.params, self.run.dataset.name)


def resolve_mu(params: Any, dataset: str) -> float:
    """``mu`` when set, else ``mu_by_dataset[dataset]``, else ``default_mu`` (the fields of
    :func:`mu_settings`)."""
    if params.mu is not None:
        return float(params.mu)
    return float(params.mu_by_dataset.get(dataset, params.default_mu))


def mu_settings(mu_by_dataset: dict[str, float], default_mu: float, paper: str) -> tuple[Any, Any, Any]:
    """The fields ``mu``, ``mu_by_dataset``, ``default_mu`` of an objective whose μ the papers set
    per dataset (FedProx, FedRL, the contrastive objective): ``mu`` when set, else the dataset's, else the default."""
    return (
        setting(None, Nullable(Number(ge=0), "null (the paper's value for the dataset) or a number >= 0"),
                "μ; null: the value for the dataset in mu_by_dataset, else default_mu", paper=paper, label="μ {}"),
        setting(mu_by_dataset, MapOf(Number(ge=0), "a mapping of dataset names to numbers >= 0"), "μ by dataset (the papers')"),
        setting(default_mu, Number(ge=0), "μ for datasets not listed"),
    )


def frozen(model: nn.Module) -> nn.Module:
    """``model`` in eval mode with no gradient: a fixed reference (a received or previous model, a generator)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model



def call(model: nn.Module, weights: Mapping[str, torch.Tensor] | None, x: torch.Tensor) -> torch.Tensor:
    """``model``'s output for ``x``, with its own weights (None) or with ``weights``."""
    return model(x) if weights is None else functional_call(model, dict(weights), (x,))


def call_layers(model: nn.Module, weights: Mapping[str, torch.Tensor] | None, x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A :class:`~fedmm.models.LayeredModel`'s (logits, output of its first ``m`` blocks) in one
    pass, with its own weights (None) or with ``weights``."""
    h, kept = x, x
    for depth, layer in enumerate(model.layers, start=1):
        h = layer(h) if weights is None else functional_call(layer, within(weights, f"layers.{depth - 1}."), (h,))
        if depth == m:
            kept = h
    return h, kept


def call_prefix(model: nn.Module, weights: Mapping[str, torch.Tensor], x: torch.Tensor, m: int) -> torch.Tensor:
    """The output of the first ``m`` blocks of a LayeredModel run with ``weights``."""
    for depth in range(m):
        x = functional_call(model.layers[depth], within(weights, f"layers.{depth}."), (x,))
    return x


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's mean cross-entropy, over the rows of weight 1 when ``rows`` is given."""
    if rows is None:
        return F.cross_entropy(logits, y)
    return mean_over_rows(F.cross_entropy(logits, y, reduction="none"), rows)


def mean_over_rows(per_row: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The mean of a per-row quantity over the rows of weight 1 (``rows``: 1/0 per row). A padded
    row's value is left out, not multiplied by 0: it may be infinite (a calibrated loss whose
    padding label is a class the client has no row of), and ∞·0 is NaN."""
    return torch.where(rows > 0, per_row, torch.zeros_like(per_row)).sum() / rows.sum()


def only_rows(values: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``values`` (first dimension: rows) with the rows of weight 0 zeroed (``rows`` None: all)."""
    return values if rows is None else values * rows.view(-1, *([1] * (values.dim() - 1)))


def within(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of ``tensors`` under ``prefix``, by the rest of their names."""
    return {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}


def parameters(model: nn.Module, weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The parameters of ``model`` by name: its own (``weights`` None) or those in ``weights``."""
    if weights is None:
        return dict(model.named_parameters())
    return {name: weights[name] for name, _ in model.named_parameters()}


def as_client_run(run: RunSettings | Mapping[str, Any]) -> RunSettings:
    """``run`` as settings: a complete plain config (a test's, a bench's) is read as a ClientApp reads it."""
    from fedmm.config import RunSettings, client_run

    if isinstance(run, RunSettings):
        return run
    return client_run(json.dumps(plain(run), sort_keys=True, default=str))


def build_local_update(run: RunSettings | Mapping[str, Any], state: RecordDict | None = None, content: RecordDict | None = None) -> LocalUpdate:
    """The objective that ``objective.name`` selects, for one train message."""
    run = as_client_run(run)
    name = run.objective.name
    declared = discover("objective")
    if name not in declared:
        raise ConfigError("objective.name", name, ", ".join(declared))
    return declared[name].objective_class(run, state, content)


CESettings.objective_class = LocalUpdate  # the base class is the plain objective
