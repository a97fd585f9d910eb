"""Model registry: the networks the experiments train, selected by ``model.name``.

Every model is a :class:`LayeredModel`: an ordered list of top-level blocks
("layers" in the sense of the FedMR / FedRL papers: a conv block, a residual
stage, a fully connected layer ...). Running the blocks in order is the forward
pass; running only the first ``m`` of them gives the intermediate representation
that layer-wise methods (FedMR layer recombination, FedRL review learning) use.

Public API
----------
MODEL_NAMES
    The names accepted by :func:`build_model`.
build_model(name, spec)
    Build a freshly initialised model. Initialisation draws only from torch's
    global RNG, so ``torch.manual_seed(s)`` before the call makes it reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fedmm.data.spec import InputSpec
from fedmm.errors import ConfigError
from fedmm.settings import Choice, Int, Nullable, Settings, setting
from fedmm.models.cnn import _build_cnn, _build_lenet
from fedmm.models.layered import LayeredModel, with_projection_head
from fedmm.models.text import build_char_lstm, build_sent_lstm
from fedmm.models.resnet import PreActBottleneck, _build_resnet20, _build_resnet20_preact
from fedmm.models.vgg import _build_vgg16

__all__ = ["IMAGE_MODEL_NAMES", "MODEL_NAMES", "TOKEN_MODEL_NAMES", "VECTORIZED_MODEL_NAMES", "LayeredModel", "PreActBottleneck", "build_model", "model_for", "with_projection_head"]

#: name -> (builder(in_channels, num_classes, image_size), input kinds it accepts)
_BUILDERS: dict[str, tuple[Callable[[int, int, int], LayeredModel], tuple[str, ...]]] = {
    "cnn": (_build_cnn, ("image",)),
    "lenet": (_build_lenet, ("image",)),
    "resnet20": (_build_resnet20, ("image",)),
    "resnet20-preact": (_build_resnet20_preact, ("image",)),
    "vgg16": (_build_vgg16, ("image",)),
}

#: name -> builder(vocab_size, num_classes, **model options) of the token models
_TOKEN_BUILDERS: dict[str, Callable[..., LayeredModel]] = {"char_lstm": build_char_lstm, "sent_lstm": build_sent_lstm}
#: Model options besides projection_dim, by model (conf/model/<name>.yaml).
_OPTIONS: dict[str, tuple[str, ...]] = {"sent_lstm": ("embedding_dim",)}

#: Models of image inputs / of token inputs (text tasks).
IMAGE_MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)
TOKEN_MODEL_NAMES: tuple[str, ...] = tuple(_TOKEN_BUILDERS)
MODEL_NAMES: tuple[str, ...] = IMAGE_MODEL_NAMES + TOKEN_MODEL_NAMES
#: Models whose clients can train as one computation (client_app/vectorized.py): the image
#: models (convolutions, BatchNorm, pooling, linear layers, dropout). The text models' ``nn.LSTM``
#: has no batching rule under ``torch.func.vmap``; their clients train one at a time.
VECTORIZED_MODEL_NAMES: tuple[str, ...] = IMAGE_MODEL_NAMES


def _check_positive(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "a positive integer")
    return value


def build_model(name: str, spec: InputSpec, projection_dim: int | None = None,
                options: Mapping[str, Any] | None = None) -> LayeredModel:
    """Build the model called ``name`` for the input described by ``spec``.

    Parameters
    ----------
    name : str
        One of :data:`MODEL_NAMES`.
    spec : InputSpec
        From :func:`fedmm.data.input_spec`: the input kind and shape and the number of classes.
    projection_dim : int, optional
        ``model.projection_dim``: replace the classifier by a projection head of this
        width and a classifier on it (:func:`~fedmm.models.layered.with_projection_head`).
    options : mapping, optional
        Further ``model`` options of the model (``sent_lstm``: ``embedding_dim``).

    Returns
    -------
    LayeredModel
        A freshly initialised model in training mode. Initialisation draws only from torch's
        global RNG, so ``torch.manual_seed(s)`` before the call makes it reproducible.

    Raises
    ------
    ConfigError
        ``model.name`` for an unknown name or an input kind the model does not take;
        ``dataset.in_channels``, ``dataset.num_classes`` or ``dataset.image_size`` for a
        non-positive value; ``dataset.image_size`` for an image too small for the model
        (``vgg16`` needs at least 32).
    """
    if name in _TOKEN_BUILDERS:
        if spec.kind != "tokens":
            raise ConfigError("model.name", name, f"a model for {spec.kind} inputs ({name} takes token inputs)")
        vocab = _check_positive("dataset.vocab_size", spec.vocab_size)
        classes = _check_positive("dataset.num_classes", spec.num_classes)
        extra = {k: _check_positive(f"model.{k}", v) for k, v in (options or {}).items() if v is not None}
        model = _TOKEN_BUILDERS[name](vocab, classes, **extra)
        if projection_dim is not None:
            model = with_projection_head(model, _check_positive("model.projection_dim", projection_dim))
        return model
    if name not in _BUILDERS:
        raise ConfigError("model.name", name, ", ".join(MODEL_NAMES))
    builder, kinds = _BUILDERS[name]
    if spec.kind not in kinds:
        raise ConfigError("model.name", name, f"a model for {spec.kind} inputs ({name} takes {', '.join(kinds)} inputs)")
    in_channels = _check_positive("dataset.in_channels", spec.in_channels)
    num_classes = _check_positive("dataset.num_classes", spec.num_classes)
    image_size = _check_positive("dataset.image_size", spec.image_size)
    model = builder(in_channels, num_classes, image_size)
    if projection_dim is not None:
        model = with_projection_head(model, _check_positive("model.projection_dim", projection_dim))
    return model


def model_options(model: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The architecture options that the ``model`` settings set (e.g. ``sent_lstm``'s
    ``embedding_dim``), as sorted pairs (hashable)."""
    return tuple(sorted((k, model[k]) for k in _OPTIONS.get(model["name"], ()) if k in model))


def model_for(run: Any, spec: InputSpec) -> LayeredModel:
    """The model of a run (its ``model`` settings: the name, the options, a projection head)."""
    model = run.model if isinstance(run, Settings) else run["model"]
    return build_model(model["name"], spec, model.get("projection_dim"), dict(model_options(model)))


@dataclass
class ModelSettings(Settings):
    """A model of :data:`MODEL_NAMES` (its architecture is fixed by the name and the dataset)."""

    group = "model"
    keyed = False
    options_for = tuple(n for n in MODEL_NAMES if n not in _OPTIONS)
    name: str = setting("???", Choice(*MODEL_NAMES), "which architecture")
    projection_dim: int | None = setting(
        None, Nullable(Int(min=1), "null (no projection head) or its width, an integer >= 1"),
        "width of a projection head before the classifier (set by objectives that need one)",
        node="${oc.select:objective.projection_dim,null}")


@dataclass
class SentLSTMSettings(ModelSettings):
    """``sent_lstm``: its embedding width is an option (300 with 300-d GloVe vectors)."""

    options_for = ("sent_lstm",)
    embedding_dim: int = setting(100, Int(min=1), "embedding width (300 with 300-d GloVe vectors: dataset.embeddings_path)")
