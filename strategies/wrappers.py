"""Strategies of this package run their own loop: a wrapper that runs Flower's loop around one is refused."""

from __future__ import annotations

from typing import Any

from flwr.serverapp.strategy import Strategy


class WrapperRefused(RuntimeError):
    """A strategy of this package was wrapped by a strategy that runs Flower's loop around it."""


def refuse_wrapper(strategy: Strategy, caller: Any) -> None:
    """Raise :class:`WrapperRefused` when ``caller`` (whoever asked ``strategy`` for its summary,
    as a strategy's ``start`` does) is another Flower strategy: a wrapper drives
    ``configure_train`` / ``aggregate_train`` from Flower's loop, which none of these methods
    can be run by correctly, and Flower's DP wrappers would be silently wrong."""
    if not isinstance(caller, Strategy) or caller is strategy:
        return
    name, wrapper = type(strategy).__name__, type(caller).__name__
    dp = "DifferentialPrivacy" in wrapper
    raise WrapperRefused(
        f"{name} cannot run inside {wrapper}: "
        + (f"the wrapper clips each reply against the one ArrayRecord it hands {name} (not the model that node was "
           f"sent: {name} keeps its own models, one per node for the multi-model methods) and adds its noise to the "
           f"arrays {name} returns, while the models {name} sends next round are its own and never noised, so the "
           "privacy guarantee it reports would not hold. " if dp else
           f"the wrapper runs Flower's round loop, which skips {name}'s own (checkpoints, multi-phase rounds, its "
           "models). ")
        + f"Run {name} unwrapped ({name}.start), bounding each update against the model its node was sent with "
        "strategy.defence.clip_update_norm or adaptive_clip (no noise: no differential-privacy guarantee); "
        + ("for differentially private training use Flower's own FedAvg inside the wrapper." if dp else "")
    )
