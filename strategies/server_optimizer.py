"""Server optimizers: how a one-model method's server steps from its model to the next.

A one-model method (FedAvg, SCAFFOLD, FedGen, FedBuff, any preset of theirs) computes the next
model x̂ from the round's updates; a server optimizer takes that as a pseudo-gradient,
Δ = x_t − x̂ (the step the method would take), and steps x_t with its own rule: server momentum,
adaptive moments (Reddi et al., ICLR 2021). The ``server_optimizer`` config group selects one
(``none``: the method's own step); each is one file of this package, found by its declaration,
like a method.

It acts on every floating entry of the model (BatchNorm's running statistics too, as Flower's
strategies do); integer entries take the method's values. The arithmetic is in float64, the
result in each entry's own dtype. A method whose evaluated model is not the model it trains next
(FedExP, FedDyn) or that keeps several models refuses one (:func:`strategies.contract.steps_one_model`: the
server step's stage refuses it, :class:`strategies.stages.ServerStep`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fedmm.errors import ConfigError
from fedmm.protocol import ModelDict
from fedmm.settings import Settings


@dataclass
class ServerOptimizerSettings(Settings):
    """The ``server_optimizer`` group: ``none`` keeps the method's own step; an optimizer's
    declaration extends this one (its settings, its class: ``optimizer_class``)."""

    group = "server_optimizer"
    option = "none"
    title = ""
    #: The optimizer these settings build (None: the method's own step).
    optimizer_class: ClassVar[type[ServerOptimizer] | None] = None

    def build(self) -> ServerOptimizer | None:
        """The optimizer of these settings (None for ``none``)."""
        return None if self.optimizer_class is None else self.optimizer_class(self)


class ServerOptimizer:
    """One server optimizer (module docstring): :meth:`step`, and its state for checkpoints.

    Parameters
    ----------
    settings : ServerOptimizerSettings
        Its declaration's values (read as attributes: ``self.eta``).
    """

    Settings: ClassVar[type[ServerOptimizerSettings]] = ServerOptimizerSettings

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Settings" in cls.__dict__:
            cls.Settings.optimizer_class = cls

    def __init__(self, settings: ServerOptimizerSettings | None = None, **changes: Any) -> None:
        settings = settings if settings is not None else self.Settings()
        self.settings = settings.replace(**changes) if changes else settings

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__.get("settings")
        if settings is not None and name in type(settings).__dataclass_fields__:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def step(self, server_round: int, current: Mapping[str, np.ndarray], proposed: Mapping[str, np.ndarray]) -> ModelDict:
        """x_{t+1} from x_t (``current``) and the method's next model x̂ (``proposed``): each
        floating entry through :meth:`update` with the pseudo-gradient Δ = x_t − x̂ (float64),
        each integer entry as proposed."""
        floating = [k for k, v in current.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]
        grads = {k: np.asarray(current[k], np.float64) - np.asarray(proposed[k], np.float64) for k in floating}
        moved = self.update(server_round, {k: np.asarray(current[k], np.float64) for k in floating}, grads)
        return {k: (moved[k].astype(np.asarray(v).dtype) if k in moved else v) for k, v in proposed.items()}

    def update(self, server_round: int, x: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The optimizer's rule: x_{t+1} from x_t and the pseudo-gradient, entry by entry (override this)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Its state across rounds (moments), for checkpoints."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
