"""Defences against hostile updates: one stage every accepted update passes through.

The round loop (:meth:`strategies.base.RoundLoopStrategy.finish_train`, and the asynchronous
loops' ``close``) hands the round's accepted updates to :meth:`Defence.screen_and_bound` with
the model each was sent, before the method sees any of them (``on_update``, ``aggregate``).
Every quantity is taken per update against *its own* sent model, so the K models of FedMR,
FedCross and FedMut are defended one by one:

- ``screen``: an update whose direction disagrees with the round's coordinate-wise median
  update (cosine similarity at most ``screen``) is rejected; its model stays as it was sent.
  A sign-flipped update points away from the median; a free rider's update (the model it got,
  returned) has no direction at all (cosine 0). Needs at least 3 updates in the round (with
  fewer the median is not robust, and nothing is screened).
- ``adaptive_clip``: each update's L2 norm is bounded by ``adaptive_clip`` × the median norm of
  the round's updates (a scaled update is brought back to an honest size whatever the scale).
- ``clip_update_norm``: a fixed L2 bound, as before.

``robust_mean`` is the other half: the mean a method takes of client models (FedAvg's
aggregate, the multi-model methods' global model, FedExP's, FedDyn's and SCAFFOLD's mean step)
becomes a coordinate-wise median or trimmed mean (:func:`client_mean`, :func:`robust_mean`).

A method for which a defence has no meaning declares it in ``refused_defences`` of its settings
(``{setting: why}``); :meth:`refuse` turns a value other than the default into a
:class:`~fedmm.errors.ConfigError` when the settings are validated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Choice, Nullable, Number, Settings, setting
from strategies.aggregation import robust_mean_models


@dataclass
class DefenceSettings(Settings):
    """Optional defences against hostile updates (off by default, so the papers' numbers stand):
    each accepted update screened and bounded against the model it was sent (per model for the
    multi-model methods), and a robust mean where the method takes a mean of client models."""

    keyed = False
    clip_update_norm: float | None = setting(None, Nullable(Number(gt=0), "null (off) or an L2 norm > 0"),
                                             "scale each update (model − the model it was sent) down to at most this L2 norm",
                                             label="update norm ≤ {}")
    adaptive_clip: float | None = setting(None, Nullable(Number(gt=0), "null (off) or a multiple > 0"),
                                          "scale each update down to at most this multiple of the median update norm "
                                          "of the round", label="update norm ≤ {}× median")
    screen: float | None = setting(None, Nullable(Number(ge=-1, lt=1), "null (off) or a cosine in [-1, 1)"),
                                   "reject an update whose cosine similarity to the round's coordinate-wise median "
                                   "update is at most this (0: opposite or no direction); needs >= 3 updates",
                                   label="screen cos > {}")
    robust_mean: str = setting("none", Choice("none", "median", "trimmed"),
                               "none: the method's own mean | median: coordinate-wise | trimmed: coordinate-wise "
                               "trimmed mean (unweighted)", label="{} mean")
    trim_fraction: float = setting(0.1, Number(ge=0, lt=0.5), "share of each coordinate's largest and smallest values "
                                   "left out by the trimmed mean")

    @property
    def stage_on(self) -> bool:
        """Whether the per-update stage does anything."""
        return self.clip_update_norm is not None or self.adaptive_clip is not None or self.screen is not None


#: The stage's settings (those acting on each update, before the method), and the mean's.
STAGE = ("clip_update_norm", "adaptive_clip", "screen")
MEAN = ("robust_mean",)


def refuse(defence: DefenceSettings, refused: Mapping[str, str], method: str) -> None:
    """A :class:`ConfigError` for the first setting ``refused`` names that is not its default."""
    defaults = DefenceSettings()
    for name, why in refused.items():
        value = getattr(defence, name)
        if value != getattr(defaults, name):
            raise ConfigError(f"strategy.defence.{name}", value,
                              f"{getattr(defaults, name)!r} with strategy={method} ({why})".replace("None", "null"))


def defend(defence: DefenceSettings, updates: list[ClientUpdate], sent: Sequence[Mapping[str, np.ndarray]],
           names: list[str], rejected: list[str], round_log: dict[str, float]) -> list[ClientUpdate]:
    """The stage (:meth:`Defence.screen_and_bound`) on a round's accepted ``updates``
    (``sent[i]``: the model ``updates[i]`` was sent, ``names[i]``: how logs name its node): the
    updates kept; each screened reply's reason goes into ``rejected``, the stage's numbers into
    ``round_log``."""
    verdict = Defence(defence).screen_and_bound(updates, sent)
    by_id = {id(u): name for u, name in zip(updates, names)}
    rejected.extend(f"{by_id[id(u)]}: {reason}" for u, reason in verdict.rejected)
    round_log.update(verdict.log)
    return verdict.kept


def robust_mean(defence: DefenceSettings, models: list[ModelDict]) -> ModelDict | None:
    """``defence.robust_mean`` of ``models`` (unweighted), or None when it is off."""
    if defence.robust_mean == "none" or not models:
        return None
    return robust_mean_models(models, defence.robust_mean, defence.trim_fraction)


def client_mean(defence: DefenceSettings, models: list[ModelDict], own: Callable[[], ModelDict]) -> ModelDict:
    """The mean a method takes of client models: ``defence.robust_mean`` of ``models`` when one
    is set, else the method's own mean, ``own()``."""
    robust = robust_mean(defence, models)
    return own() if robust is None else robust


def _floating(model: Mapping[str, np.ndarray]) -> list[str]:
    return [k for k, v in model.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]


@dataclass
class Verdict:
    """What the stage did to a round's updates."""

    kept: list[ClientUpdate]
    rejected: list[tuple[ClientUpdate, str]] = field(default_factory=list)
    log: dict[str, float] = field(default_factory=dict)


class Defence:
    """The per-update stage of :class:`DefenceSettings` (module docstring)."""

    def __init__(self, settings: DefenceSettings) -> None:
        self.settings = settings

    def screen_and_bound(self, updates: list[ClientUpdate], sent: Sequence[Mapping[str, np.ndarray]]) -> Verdict:
        """Screen, then bound, ``updates`` (``sent[i]``: the model ``updates[i]`` was sent)."""
        s = self.settings
        if not s.stage_on or not updates:
            return Verdict(list(updates))
        keys = _floating(updates[0].model)
        deltas = [{k: np.asarray(u.model[k], np.float64) - np.asarray(m[k], np.float64) for k in keys}
                  for u, m in zip(updates, sent)]
        norms = np.array([np.sqrt(sum(float(np.vdot(d[k], d[k])) for k in keys)) for d in deltas])
        verdict = Verdict([], log={"largest_update_norm": float(norms.max())})
        keep = np.ones(len(updates), bool)
        if s.screen is not None and len(updates) >= 3:
            cosines = self._cosines(deltas, norms, keys)
            keep = cosines > s.screen
            verdict.log["updates_screened"] = float((~keep).sum())
            verdict.log["smallest_cosine"] = float(cosines.min())
            for i in np.flatnonzero(~keep):
                verdict.rejected.append((updates[i], f"defence.screen: cosine {cosines[i]:.3f} to the round's median "
                                                     f"update is at most {s.screen:g}"))
        bound = np.inf
        if s.clip_update_norm is not None:
            bound = float(s.clip_update_norm)
        if s.adaptive_clip is not None and keep.any():
            median = float(np.median(norms[keep]))
            bound = min(bound, s.adaptive_clip * median)
            verdict.log["update_norm_bound"] = bound
        scaled = 0
        for i, update in enumerate(updates):
            if not keep[i]:
                continue
            if norms[i] > bound and norms[i] > 0:
                scale = bound / norms[i]
                model = dict(update.model)
                for k in keys:
                    value = np.asarray(update.model[k])
                    model[k] = (np.asarray(sent[i][k], np.float64) + deltas[i][k] * scale).astype(value.dtype)
                update.model = model
                scaled += 1
            verdict.kept.append(update)
        if np.isfinite(bound):
            verdict.log["updates_scaled"] = float(scaled)
        return verdict

    @staticmethod
    def _cosines(deltas: list[dict[str, np.ndarray]], norms: np.ndarray, keys: list[str]) -> np.ndarray:
        """Each delta's cosine similarity to the coordinate-wise median delta (0 for a zero delta)."""
        dots = np.zeros(len(deltas))
        median_sq = 0.0
        for k in keys:
            median = np.median(np.stack([d[k] for d in deltas]), axis=0)
            median_sq += float(np.vdot(median, median))
            dots += [float(np.vdot(d[k], median)) for d in deltas]
        scale = norms * np.sqrt(median_sq)
        return np.divide(dots, scale, out=np.zeros_like(dots), where=scale > 0)
