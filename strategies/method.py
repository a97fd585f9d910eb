"""A method: its models and its arithmetic, apart from the loop that drives it.

A method subclasses :class:`Method` (or :class:`~strategies.multimodel.MultiModel` for K models
kept on the server) and says, in its own words, only what makes it itself:

- its settings, declared once (``Settings``: a :class:`~strategies.strategy_settings.StrategySettings`
  subclass; ``strategy=<its option>`` selects it, nothing lists it);
- its models (:meth:`Method.initialize`; ``self.models``, ``self.global_model``) and which one
  each selected node is sent (:meth:`Method.model_for_slot`);
- how the round's accepted updates fold into its models (:meth:`Method.aggregate`), through the
  mean it is handed (:class:`~strategies.aggregators.Mean`);
- what else it sends and expects (:meth:`Method.extra_records`, :meth:`Method.reply_extras`),
  what it needs to know of the round's nodes (:meth:`Method.prepare_round`), and its state for
  checkpoints (``state_dict`` / ``load_state_dict``, extending ``super()``'s).

It knows nothing of rounds, messages, clocks, timeouts or defences: a driver runs it (the
synchronous round, the asynchronous loop, secure recombination), and every round ends with the
same stages (:mod:`strategies.rounds`: the defence stage before the method sees any update, the
NaN guard and the frozen arrays after). What a method holds decides which settings apply to it
(:attr:`Method.holds`, read by the settings' checks): nothing is listed by hand.

The class is a Flower ``Strategy`` (through :class:`~strategies.base.FedmmStrategy`), so
``FedAvg(10, seed=0).start(grid, ...)`` works in any Flower app.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fedmm import protocol
from fedmm.protocol import ClientUpdate, ModelDict
from strategies.aggregators import Mean
from strategies.base import FedmmStrategy, Participants
from strategies.defence import ONE_MODEL, PER_CLIENT, PER_NODE  # noqa: F401 - what a method holds, re-exported
from strategies.rounds import SyncRound


class Method(FedmmStrategy):
    """Base of every method (module docstring); by itself one model, sent to every selected node.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector, settings, num_clients, changes
        See :class:`~strategies.base.FedmmStrategy`.
    """

    #: What the method holds: :data:`ONE_MODEL`, :data:`PER_NODE` or :data:`PER_CLIENT`.
    holds: ClassVar[str] = ONE_MODEL
    #: The driver of its rounds: the synchronous round (:class:`strategies.asynchronous.AsyncRound`
    #: for a method without a round barrier).
    Driver = SyncRound
    #: The global model is the model the method trains next (False: FedExP, FedDyn evaluate another).
    global_is_next: ClassVar[bool] = True
    #: What the method releases under differential privacy (:mod:`strategies.privacy`): ``"mean"``
    #: (its next model is the mean of the round's updates: noise on that mean), ``"models"`` (its
    #: models are functions of the K trained models: noise on each of those), or ``""`` (refused,
    #: :attr:`private_refused` says why).
    releases: ClassVar[str] = "mean"
    private_refused: ClassVar[str] = ""

    @classmethod
    def steps_one_model(cls) -> bool:
        """Whether a server optimizer can step this method's model: it holds one model, which is
        also its global model (:mod:`strategies.server_optimizer`)."""
        return cls.holds == ONE_MODEL and cls.global_is_next

    def initialize(self, initial: ModelDict) -> None:
        """The models from the initial model (default: one model, which is the global model)."""
        self.models = [initial]
        self.global_model = initial

    def model_for_slot(self, slot: int) -> int:
        """Index of the server model sent to the ``slot``-th selected node (default: model 0)."""
        return 0

    def prepare_round(self, server_round: int, participants: Participants) -> None:
        """Called with the round's selected nodes (:class:`~strategies.base.Participants`, in slot
        order) before their messages are built (e.g. to put each node's own model in its slot).
        Default: nothing."""

    def extra_records(self, server_round: int, slot: int) -> dict[str, Any]:
        """Further records of the train message of ``slot`` (e.g. a control variate)."""
        return {}

    def reply_extras(self, server_round: int) -> dict[str, protocol.ArraySpec]:
        """ArrayRecords, by name, that every train reply must carry besides ``arrays``."""
        return {}

    def reply_metrics(self) -> tuple[str, ...]:
        """Metrics every train reply must carry, each a finite number > 0 (a reply without is
        rejected when it arrives)."""
        return ()

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        """Turn the round's accepted updates (each with the model it was ``sent``) into the
        server's next models, averaging through ``mean``; return the global model (None:
        unchanged). The updates' arrays are read-only unless ``writable_updates``; the server's
        own arrays are never written in place (replace them). Override this."""
        raise NotImplementedError
