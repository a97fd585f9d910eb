"""SCAFFOLD (Karimireddy et al., ICML 2020): the server side of Option II.

The server keeps the model x and the control variate c (one array per trainable parameter,
zeros at the start). Every selected client gets x (``arrays``) and c (``control``); it answers
with its trained model y_i (``arrays``: Δy_i = y_i − x is computed here, the bytes are the same)
and Δc_i (``control-delta``), and keeps its own c_i (objective ``scaffold``, client side). Then

    x ← x + η_g · (1/|S|) Σ_i Δy_i        (trainable parameters; ``weighting: examples``: Σ p_i Δy_i)
    c ← c + (1/N) Σ_i Δc_i                (N = num_clients, not |S|: c stays the mean of all c_i)

BatchNorm buffers (and any other non-trainable entry) are the example-weighted mean of the
replies, as FedAvg. Traffic: model + c down, model + Δc up: 2× FedAvg both ways for a model
without buffers.

``weighting: examples`` is the authors' lab variant (``strategy=scaffold_lab``): the model is the
sample-size weighted mean, each client's data weight w_i = N·n_i/Σn (sizes from the roster query)
goes to the client, which corrects with c/w_i − c_i, and c ← c + (1/N) Σ_i w_i·Δc_i.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ConfigRecord
from flwr.supercore import log

from fedmm import protocol
from fedmm.errors import ConfigError
from fedmm.settings import Choice, Number, setting
from fedmm.protocol import ClientUpdate, ModelDict
from objectives import scaffold as scaffold_client
from strategies.aggregation import weighted_mean_models
from strategies.aggregators import Mean
from strategies.base import Participants
from strategies.extrapolation import is_buffer
from strategies.fedavg import FedAvg
from strategies.method import Needs, refused
from strategies.selection import ClientSelector
from strategies.strategy_settings import StrategySettings

@dataclass
class ScaffoldSettings(StrategySettings):
    """SCAFFOLD's server (Karimireddy et al., ICML 2020, Option II); its clients run the
    ``scaffold`` objective (selected with the method)."""

    option = "scaffold"
    title = "SCAFFOLD"
    server_lr: float = setting(1.0, Number(gt=0), "η_g", paper="1.0")
    weighting: str = setting("uniform", Choice("uniform", "examples"), "uniform: x += η_g mean(Δy_i), c += Σ Δc_i / N "
                             "(the paper) | examples: the lab variant (data-size weights)")

    @property
    def display(self) -> str:
        return "SCAFFOLD (lab)" if self.weighting == "examples" else super().display

    @property
    def needs_sizes(self) -> bool:
        """The ``examples`` weighting asks the nodes for their sizes in the roster query."""
        return self.weighting == "examples" or super().needs_sizes

def scaffold_step(
    x: Mapping[str, np.ndarray],
    c: Mapping[str, np.ndarray],
    models: list[Mapping[str, np.ndarray]],
    deltas: list[Mapping[str, np.ndarray]],
    examples: list[float],
    num_clients: int,
    server_lr: float = 1.0,
    model_weights: list[float] | None = None,
    control_weights: list[float] | None = None,
    robust: tuple[ModelDict, ModelDict] | None = None,
) -> tuple[ModelDict, ModelDict]:
    """(x⁺, c⁺) from the trained models y_i and their Δc_i.

    Trainable entries: x + η_g·Σ_i q_i(y_i − x) with q_i = ``model_weights`` normalised (None:
    1/|S|); non-trainable entries: the ``examples``-weighted mean. c⁺ = c + (1/N)·Σ_i v_i·Δc_i with
    v_i = ``control_weights`` (None: 1). ``robust``: robust means of the models and of the Δc_i
    (``strategy.defence.aggregator``): x⁺ = x + η_g·(robust model − x) (buffers: the robust
    model's), c⁺ = c + (|S|/N)·(robust Δc).
    """
    if robust is not None:
        model_mean, control_mean = robust
        x_next = {k: model_mean[k] if is_buffer(k, v) else (v + server_lr * (model_mean[k].astype(np.float64) - v)).astype(v.dtype)
                  for k, v in x.items()}
        c_next = {k: (v + len(deltas) / num_clients * control_mean[k].astype(np.float64)).astype(v.dtype) for k, v in c.items()}
        return x_next, c_next
    q = np.full(len(models), 1.0 / len(models)) if model_weights is None else np.asarray(model_weights, float) / np.sum(model_weights)
    buffers = weighted_mean_models(models, examples if sum(examples) > 0 else [1.0] * len(models))
    out: ModelDict = {}
    for key, value in x.items():
        if is_buffer(key, value):
            out[key] = buffers[key]
            continue
        step = np.zeros(value.shape, dtype=np.float64)
        for weight, model in zip(q, models):
            step += weight * (model[key].astype(np.float64) - value)
        out[key] = (value + server_lr * step).astype(value.dtype)
    v = [1.0] * len(deltas) if control_weights is None else list(control_weights)
    new_c: ModelDict = {}
    for key, value in c.items():
        acc = np.zeros(value.shape, dtype=np.float64)
        for weight, delta in zip(v, deltas):
            acc += weight * delta[key]
        new_c[key] = (value + acc / num_clients).astype(value.dtype)
    return out, new_c


class Scaffold(FedAvg):
    """SCAFFOLD's server on the one-model round loop.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector
        See :class:`~strategies.base.FedmmStrategy`.
    num_clients : int
        N, the denominator of the control-variate update.
    server_lr : float
        η_g (1 in every reference implementation).
    weighting : str
        ``uniform`` (the paper) or ``examples`` (the authors' lab code; needs the clients' sizes
        from the roster query, which its settings ask for: ``ScaffoldSettings.needs_sizes``).
    """

    Settings = ScaffoldSettings
    releases = refused("its control variate c, the mean of the clients' Δc_i, is sent to every client: a second "
                       "release of client data this analysis does not cover")

    def __init__(self, clients_per_round: int | None = None, seed: int = 0, num_clients: int | None = None,
                 fraction_evaluate: float | None = None,
                 selector: ClientSelector | None = None, **settings: Any) -> None:
        if num_clients is None:
            raise TypeError("Scaffold() missing the argument num_clients (N: the denominator of the control-variate update)")
        super().__init__(clients_per_round, seed, fraction_evaluate, selector, num_clients=int(num_clients), **settings)
        self.control: ModelDict | None = None
        self._encoded_control: Any = None
        self._data_weights: dict[int, float] = {}
        self._slot_nodes: list[int] = []

    def initialize(self, initial: ModelDict) -> None:
        """x = the initial model, c = 0 over its trainable entries."""
        super().initialize(initial)
        self.control = {k: np.zeros_like(v) for k, v in initial.items() if not is_buffer(k, v)}

    def prepare_round(self, server_round: int, participants: Participants) -> None:
        """Encode c once for the round; ``examples`` weighting: each node's w_i = N·n_i/Σn."""
        assert self.control is not None
        self._encoded_control = protocol.model_to_record(self.control)
        node_ids = self._slot_nodes = list(participants.ids)
        if self.settings.weighting == "examples":
            sizes = participants.sizes
            missing = [n for n in node_ids if n not in sizes]
            if missing:
                raise RuntimeError(f"SCAFFOLD weighting=examples needs every client's size from the roster query; "
                                   f"node {missing[0]} reported none (use weighting=uniform)")
            total = float(sum(sizes.values()))
            self._data_weights = {n: len(sizes) * sizes[n] / total for n in node_ids}

    def extra_records(self, server_round: int, slot: int) -> dict[str, Any]:
        """c (and, ``examples`` weighting, the node's data weight)."""
        records: dict[str, Any] = {scaffold_client.CONTROL: self._encoded_control}
        if self.settings.weighting == "examples":
            records[scaffold_client.CONTROL_CONFIG] = ConfigRecord({scaffold_client.CONTROL_WEIGHT: self._data_weights[self._slot_nodes[slot]]})
        return records

    def needs(self, server_round: int) -> Needs:
        """Every reply carries Δc_i, shaped like c."""
        assert self.control is not None
        return Needs(arrays={scaffold_client.CONTROL_DELTA: protocol.array_spec(self.control)})

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        """x and c as in the module docstring."""
        if not updates:
            return None
        assert self.models is not None and self.control is not None
        examples = [u.num_examples for u in updates]
        lab = self.settings.weighting == "examples"
        x, c = scaffold_step(
            self.models[0], self.control, [u.model for u in updates], [u.extras[scaffold_client.CONTROL_DELTA] for u in updates],
            examples, self.num_clients, self.settings.server_lr,
            model_weights=examples if lab else None,
            control_weights=[self._data_weights[u.node_id] for u in updates] if lab else None,
            robust=(mean([u.model for u in updates]), mean([u.extras[scaffold_client.CONTROL_DELTA] for u in updates], deltas=True))
            if mean.robust else None,
        )
        self.models, self.control = [x], c
        return x

    def state_dict(self) -> dict[str, Any]:
        """The models, RNG, selector and c (the clients' c_i live on the nodes)."""
        return {**super().state_dict(), "control": self.control}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self.control = state["control"]
