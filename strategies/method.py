"""The method contract: what a method declares and the hooks it may override, nothing else.

A method subclasses :class:`Method` (or :class:`~strategies.multimodel.MultiModel` for K models
kept on the server) and says, in its own words, only what makes it itself
(docs/adding_a_method.md walks through three):

- its settings, declared once (``Settings``: a :class:`~strategies.strategy_settings.StrategySettings`
  subclass; ``strategy=<its option>`` selects it, nothing lists it), read as ``self.settings``;
- what it holds (:attr:`Method.holds`: one model, a model per node of the round, a model per
  client), which decides which model each selected node is sent (:func:`model_index`), the
  defence settings that apply and whether a server optimizer can step it;
- its models (:meth:`Method.initialize`; ``self.models``, ``self.global_model``);
- what it sends besides the model and what it needs from its clients
  (:meth:`Method.extra_records`, :meth:`Method.needs`: records and metrics each reply must carry,
  measurements the ClientApp makes for it such as the loss before training);
- how the round's accepted updates fold into its models (:meth:`Method.aggregate`), through the
  mean it is handed (:class:`~strategies.aggregators.Mean`);
- what it releases under differential privacy (``releases``, declared beside its ``aggregate``);
- the drivers it runs under (:attr:`Method.drivers`) and its state for checkpoints
  (``state_dict`` / ``load_state_dict``, extending ``super()``'s).

**What a method does not declare is refused, never assumed.** A class that defines ``aggregate``
without ``releases`` in its own body runs under no differential privacy (:func:`release_of`: a
subclass's arithmetic is not its parent's); a driver not in ``drivers`` is refused when the
settings are validated. Everything else of a run (selector, virtual clock, replies, observers,
the round's end stages, the server optimizer, the driver) is the run context's
(:class:`strategies.context.RunContext`, ``strategy.context``), never the method's.

The class is a Flower ``Strategy`` (through :class:`~strategies.base.FedmmStrategy`), so
``FedAvg(10, seed=0).start(grid, ...)`` works in any Flower app.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from fedmm.protocol import ClientUpdate, ModelDict
from strategies.aggregators import Mean
from strategies.base import FedmmStrategy, Participants
from strategies.contract import (  # noqa: F401 - the declarations a method makes, re-exported
    ASYNC, MEAN, MODELS, ONE_MODEL, PER_CLIENT, PER_NODE, SECURE, SYNC, Needs, Refused, model_index, refused, release_of,
    release_refusal, steps_one_model)

class Method(FedmmStrategy):
    """Base of every method (module docstring); by itself one model, sent to every selected node.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector, settings, num_clients, changes
        See :class:`~strategies.base.FedmmStrategy`.
    """

    #: What the method holds: :data:`ONE_MODEL`, :data:`PER_NODE` or :data:`PER_CLIENT`.
    holds: ClassVar[str] = ONE_MODEL
    #: The drivers it runs under (the synchronous round; add :data:`ASYNC` or :data:`SECURE` when its
    #: arithmetic serves them).
    drivers: ClassVar[tuple[str, ...]] = (SYNC,)
    #: The global model (evaluated, saved) is the model it trains next (False: FedExP, FedDyn).
    global_is_next: ClassVar[bool] = True

    def initialize(self, initial: ModelDict) -> None:
        """The models from the initial model (default: one model, which is the global model)."""
        self.models = [initial]
        self.global_model = initial

    def prepare_round(self, server_round: int, participants: Participants) -> None:
        """Called with the round's selected nodes (:class:`~strategies.base.Participants`, in slot
        order) before their messages are built (e.g. to put each node's own model in its slot).
        Default: nothing."""

    def extra_records(self, server_round: int, slot: int) -> dict[str, Any]:
        """Further records of the train message of ``slot`` (e.g. a control variate)."""
        return {}

    def needs(self, server_round: int) -> Needs:
        """What every train reply of ``server_round`` must carry besides the model (:class:`Needs`)."""
        return Needs()

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        """Turn the round's accepted updates (each with the model it was ``sent``) into the
        server's next models, averaging through ``mean``; return the global model (None:
        unchanged). The updates' arrays are read-only unless the method holds a model per node;
        the server's own arrays are never written in place (replace them). Override this, and
        declare ``releases`` beside it."""
        raise NotImplementedError

    def models_to_evaluate(self) -> list[ModelDict] | None:
        """Models the central evaluation reports on besides the global model: a method with a
        model per client (SOLO) has them evaluated instead of it (mean and spread of their
        accuracy), any other beside it (``model_<i>_accuracy``); None: the global model only."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The method's state for checkpoints and for a rolled-back round: its models, global
        model and RNG (a method with state of its own extends it: ``super().state_dict()``)."""
        return {"models": None if self.models is None else list(self.models), "global_model": self.global_model,
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.models = None if state["models"] is None else list(state["models"])
        self.global_model = state["global_model"]
        self.rng.bit_generator.state = state["rng"]
