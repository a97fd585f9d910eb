"""The declarations of the method contract and what is derived from them (imports no method).

:mod:`strategies.method` is the contract a method follows; this module holds the values it
declares (what it holds, releases and runs under, what it needs from its clients) and the rules
derived from them, so that the drivers, the stages of the round's end and the settings' checks
read them without importing a method.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedmm import protocol
from strategies.defence import ONE_MODEL, PER_CLIENT, PER_NODE  # noqa: F401 - what a method holds

#: What a method releases under differential privacy (:mod:`strategies.privacy`): its next model
#: is the mean of the round's updates (noise on that mean, scaled to the updates that came back) ...
MEAN = "mean"
#: ... or its models are functions of the trained models, one per client or per group of clients
#: (noise on each group's mean; whatever the method does with them afterwards is post-processing).
MODELS = "models"
#: The drivers a method may run under (:mod:`strategies.drivers`): the synchronous round, the
#: asynchronous loop (``strategy.asynchronous.enabled``), FedMR's secure recombination
#: (``strategy.secure.enabled``).
SYNC, ASYNC, SECURE = "sync", "async", "secure"


@dataclass(frozen=True)
class Participants:
    """The round's selected nodes, in slot order: their ids, their stable keys (partition id or
    data path, across runs), and the training-set sizes the nodes reported in the roster query
    (every node that reported one, selected or not)."""

    ids: list[int]
    keys: list[str]
    sizes: dict[int, float]


@dataclass(frozen=True)
class Refused:
    """A release refused under differential privacy, with why (``releases = refused("...")``)."""

    reason: str


def refused(reason: str) -> Refused:
    """``releases = refused("why")``: the method runs under no differential privacy, and says why."""
    return Refused(reason)


@dataclass(frozen=True)
class Needs:
    """What a method needs from each train reply besides the trained model.

    ``arrays``: ArrayRecords by name with their spec (SCAFFOLD's Δc); ``metrics``: metric names,
    each a finite number > 0 (FedNova's ``fednova-a``), or a measurement the fedmm ClientApp
    makes when asked (:data:`fedmm.protocol.MEASURABLE`: ``loss-before``, the loss of the
    received model on the node's training rows before training). A reply without one of them
    is rejected when it arrives.
    """

    arrays: Mapping[str, protocol.ArraySpec] = field(default_factory=dict)
    metrics: tuple[str, ...] = ()

    @property
    def measured(self) -> list[str]:
        """The metrics the ClientApp is asked to measure (``config[fedmm-measure]``)."""
        return [name for name in self.metrics if name in protocol.MEASURABLE]


def release_of(method: type) -> str | Refused | None:
    """What ``method`` releases under differential privacy: the ``releases`` of the nearest class
    (in its MRO) that declares it, unless a class nearer defines ``aggregate`` without declaring
    one (its arithmetic is its own: None, undeclared, refused)."""
    for klass in method.__mro__:
        if "releases" in klass.__dict__:
            return klass.__dict__["releases"]
        if "aggregate" in klass.__dict__:
            return None
    return None


def release_refusal(method: type) -> str:
    """Why ``method`` runs under no differential privacy ("" when it declares what it releases)."""
    release = release_of(method)
    if isinstance(release, Refused):
        return release.reason
    if release is None:
        owner = next((k for k in method.__mro__ if "aggregate" in k.__dict__), method)
        return (f"{owner.__name__} defines aggregate without declaring what it releases: add releases = MEAN, "
                "releases = MODELS or releases = refused('why') to its class (strategies.method)")
    return ""


def model_index(method: Any, slot: int) -> int:
    """The server model the ``slot``-th selected node is sent: model 0 for a method with one model,
    model ``slot`` mod the models it keeps for a model per node (K, or G under differential
    privacy's grouped releases: the clients sent one model are a group), model ``slot`` for a
    model per client (SOLO puts each selected client's own model in its slot)."""
    if method.holds == ONE_MODEL:
        return 0
    if method.holds == PER_NODE and method.models:
        return slot % len(method.models)
    return slot


def steps_one_model(method: type) -> bool:
    """Whether a server optimizer can step ``method``'s model: it holds one model, which is also
    its global model (:mod:`strategies.server_optimizer`)."""
    return method.holds == ONE_MODEL and method.global_is_next
