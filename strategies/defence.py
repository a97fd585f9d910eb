"""Defences against hostile updates: one stage every accepted update passes through.

The end of every round (:func:`strategies.rounds.end`, whichever driver runs it) hands the
round's accepted updates to :func:`defend` with the model each was sent, before the method sees
any of them (its ``aggregate``).
Every quantity is taken per update against *its own* sent model, so the K models of FedMR,
FedCross and FedMut are defended one by one:

- ``screen``: an update whose direction disagrees with the round's coordinate-wise median
  update (cosine similarity at most ``screen``) is rejected; its model stays as it was sent.
  A sign-flipped update points away from the median; a free rider's update (the model it got,
  returned) has no direction at all (cosine 0). Needs at least 3 updates in the round (with
  fewer the median is not robust, and nothing is screened).
- ``sign_screen``: an update that agrees in sign with the round's coordinate-wise median update
  on at most this share of the coordinates (where the median is not 0) is rejected (the sign
  statistics of SignGuard, Xu et al. 2022, and of signSGD's majority vote, Bernstein et al.
  2019). Under label skew a client's update can be nearly orthogonal to the median, so its
  sign-flipped copy has a cosine near 0 and passes ``screen``; the sign shares of the same
  updates stay apart (the embedded data, FedMR, 10 clients: honest 0.52-0.77, flipped
  0.43-0.54), and a free rider's update, all zeros, agrees nowhere. Needs at least 3 updates.
- ``adaptive_clip``: each update's L2 norm is bounded by ``adaptive_clip`` × the median norm of
  the round's updates (a scaled update is brought back to an honest size whatever the scale).
  With ``adaptive_clip_to=median`` an update above the bound is scaled down to the median norm
  instead (the dynamic clipping bound of FLAME, Nguyen et al. 2022, applied to outliers only):
  in the multi-model methods a bounded update is not one of K summands but the next model of
  its slot, and a scaled update at twice an honest size still moved that model twice as far
  (FedCross, 8 rounds: 0.641 against 0.747 clean), while clipping every update to the median
  cost clean runs up to 6 points; updates within the bound are left as they are.
- ``clip_update_norm``: a fixed L2 bound, as before.
- ``norm_screen``: an update whose L2 norm is above ``norm_screen`` × the round's median update
  norm is rejected rather than scaled down. A scaled-down update keeps its direction, which is an
  honest one for a scaled update but an ascent step for a boosted sign flip (× −10) that agreed
  with the median on just over half of the coordinates and passed ``sign_screen``: in the
  multi-model methods that step is the next model of its slot. Needs at least 3 updates.
- ``class_screen``: an update whose output layer disagrees, class by class, with the other
  updates that learn the same classes is rejected (label flipping). The output layer is the
  model's last 2-D weight with its bias (the classifier of every model here): an update that
  raises class k's bias trains on rows labelled k, and moves row k of the weight towards the
  features of those rows. Its agreement is the cosine of its row k to the coordinate-wise median
  row k of the other updates that raise class k, averaged over its raised classes weighted by
  how much it raises each (classes no other update raises are left out; an update with none
  is kept). A client that trains on class c's images labelled c' moves row c' towards class
  c's features, where the clients holding real c' images move it towards theirs. Updates that
  agree in sign and cosine with the round's median, as label-flipped ones under label skew do
  (``--screen-stats`` in bench/faults.py), are compared here only where they claim the same
  labels as the others (the output-layer analysis of label flipping of Tolpegin et al. 2020
  and LFighter, Jebreel et al. 2023). Needs at least 3 updates.
- ``refill``: for the methods that keep a model per node of the round (FedMR, FedCross, FedMut,
  the asynchronous FedMR and FedCross; the other methods' settings refuse it), a
  rejected update's slot takes its sent model plus the coordinate-wise median of the round's
  kept updates (as bounded) instead of staying as it was sent: a rejected node then leaves no
  untrained model behind, which the method would carry into its global mean and, by
  recombination or fusion, into the other models (FedMR lost 4 points with one free rider of
  ten in 8 rounds, its slot rejected or not). The refilled slot is not a reply: it is not in
  the round's replies, metrics or client statistics.

- ``krum_screen``: the f updates with the largest Krum scores are rejected (MultiKrum's
  selection, Blanchard et al. 2017: an update's score is the sum of its squared distances to
  its n − f − 2 nearest others). It assumes at most f hostile updates in the round and honest
  updates closer to one another than to the hostile ones; under strong label skew an honest
  update far from the others can be rejected in a round without any attacker (the f largest
  are always rejected). With ``refill`` the rejected slots take the round's median update.

- ``trust_root``: FLTrust (Cao et al., NDSS 2021): the server trains a reference update on a
  root set of this many rows no client trains on, from the model each node was sent, and each
  update is weighted by ReLU(cosine) to it and rescaled to its norm. A stage of its own, after
  this one (:mod:`strategies.trust`, :class:`strategies.stages.Trust`); the runner provides the
  server's training (``RunContext.reference``).

The other half is the mean a method takes of client models (FedAvg's aggregate, the
multi-model methods' global model, every one-model method's mean step, FedBuff's buffer):
``aggregator`` (with ``pre_aggregators`` and ``f``) makes it one of byzfl's robust
aggregators (:class:`strategies.aggregators.Mean`).

What a setting means depends on what the method holds (:attr:`strategies.method.Method.holds`),
so what a method refuses is derived from that declaration (:func:`refused_settings`), never
listed per method: ``refill`` needs a model per node; a method with a model per client (SOLO)
aggregates nothing into anyone else's model, so no setting applies; with secure recombination an
upload is no update of a model the server sent, so the stage does not apply (the mean does).
:func:`refuse` turns a refused value other than the default into a
:class:`~fedmm.errors.ConfigError` when the settings are validated. No method calls any of this:
the stage runs at every round's end (:func:`strategies.rounds.end`), and the mean reaches a
method as the :class:`~strategies.aggregators.Mean` it is handed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Bool, Choice, Int, ListOf, Nullable, Number, Settings, setting
from strategies.aggregators import AGGREGATORS, PRE_AGGREGATORS, takes_f


@dataclass
class DefenceSettings(Settings):
    """Optional defences against hostile updates (off by default, so the papers' numbers stand):
    each accepted update screened and bounded against the model it was sent (per model for the
    multi-model methods), and a robust mean where the method takes a mean of client models."""

    keyed = False
    #: Declared after runs were made: the values that reproduce those runs (the stage off).
    added = {"adaptive_clip": None, "adaptive_clip_to": "bound", "screen": None, "sign_screen": None,
             "norm_screen": None, "class_screen": None, "refill": "none", "krum_screen": False, "aggregator": "mean",
             "pre_aggregators": [], "f": 0, "bucket_size": 2, "clip_threshold": 2.0, "trust_root": None}
    #: The robust mean of our own that byzfl's aggregators replaced: what a run made with it had.
    retired = {"robust_mean": lambda how: _retired_robust_mean(how), "trim_fraction": lambda _: {}}
    clip_update_norm: float | None = setting(None, Nullable(Number(gt=0), "null (off) or an L2 norm > 0"),
                                             "scale each update (model − the model it was sent) down to at most this L2 norm",
                                             label="update norm ≤ {}")
    adaptive_clip: float | None = setting(None, Nullable(Number(gt=0), "null (off) or a multiple > 0"),
                                          "scale each update down to at most this multiple of the median update norm "
                                          "of the round", label="update norm ≤ {}× median")
    adaptive_clip_to: str = setting("bound", Choice("bound", "median"),
                                    "bound: an update above adaptive_clip × the median norm is scaled down to that "
                                    "bound | median: down to the median norm (needs adaptive_clip)",
                                    label="outliers to the {}")
    screen: float | None = setting(None, Nullable(Number(ge=-1, lt=1), "null (off) or a cosine in [-1, 1)"),
                                   "reject an update whose cosine similarity to the round's coordinate-wise median "
                                   "update is at most this (0: opposite or no direction); needs >= 3 updates",
                                   label="screen cos > {}")
    sign_screen: float | None = setting(None, Nullable(Number(ge=0, lt=1), "null (off) or a share in [0, 1)"),
                                        "reject an update that has the sign of the round's coordinate-wise median "
                                        "update on at most this share of the coordinates (0.5: a coin's); needs >= 3 "
                                        "updates", label="sign agreement > {}")
    norm_screen: float | None = setting(None, Nullable(Number(gt=1), "null (off) or a multiple > 1"),
                                        "reject an update whose L2 norm is above this multiple of the round's median "
                                        "update norm (instead of scaling it down); needs >= 3 updates",
                                        label="reject norm > {}× median")
    class_screen: float | None = setting(None, Nullable(Number(ge=-1, lt=1), "null (off) or a cosine in [-1, 1)"),
                                         "reject an update whose output-layer rows of the classes it raises have a "
                                         "cosine of at most this (weighted mean) to the median rows of the other "
                                         "updates raising those classes (label flipping); needs >= 3 updates",
                                         label="class agreement > {}")
    refill: str = setting("none", Choice("none", "median"),
                          "none: a rejected update's model stays as it was sent | median: it takes the round's "
                          "coordinate-wise median of the kept updates (methods with a model per node: FedMR, "
                          "FedCross, FedMut; needs a setting that rejects: screen, sign_screen, norm_screen or "
                          "class_screen)", label="rejected: {} update")
    krum_screen: bool = setting(False, Bool(), "reject the f updates with the largest Krum scores (each update's "
                                "summed squared distance to its n - f - 2 nearest others: MultiKrum's selection, "
                                "Blanchard et al. 2017); needs f >= 1 and n > 2f + 2 updates", label="Krum screen")
    trust_root: int | None = setting(None, Nullable(Int(min=1), "null (off) or a number of rows >= 1"),
                                     "FLTrust (Cao et al. 2021): the server trains a reference update on this many "
                                     "rows of the test split (which no client trains on, and the server no longer "
                                     "evaluates on), from the model each node was sent; each update is weighted by "
                                     "ReLU(cosine) to it and rescaled to its norm", label="FLTrust root {} rows")
    aggregator: str = setting("mean", Choice("mean", *AGGREGATORS),
                              "mean: the method's own (weighted) mean | any of byzfl's robust aggregators, which "
                              "take the place of every mean a method takes of client models (unweighted)",
                              label="{} aggregator")
    pre_aggregators: list[str] = setting([], ListOf(Choice(*PRE_AGGREGATORS)),
                                         "byzfl's pre-aggregators applied in order before the aggregator: nnm "
                                         "(nearest-neighbour mixing), bucketing, clipping, arc (adaptive robust "
                                         "clipping); need a robust aggregator", label="{} first")
    f: int = setting(0, Int(min=0), "hostile nodes tolerated: passed to every aggregator, pre-aggregator and "
                     "screen that takes it, which refuses to run without one (at least 1); the round's updates must "
                     "allow it (refused before the first round)", label="f {}")
    bucket_size: int = setting(2, Int(min=1), "s of the bucketing pre-aggregator (needs bucketing)", label="s {}")
    clip_threshold: float = setting(2.0, Number(gt=0), "c of the clipping pre-aggregator: the L2 bound of each "
                                    "update (needs clipping)", label="c {}")

    def check_values(self, prefix: str) -> None:
        """``adaptive_clip_to=median`` acts on the updates above the adaptive bound: it needs one;
        pre-aggregators need a robust aggregator, their parameters need them, and ``f`` something
        that takes it."""
        robust = self.aggregator != "mean"
        if self.pre_aggregators and not robust:
            raise ConfigError(f"{prefix}pre_aggregators", self.pre_aggregators, f"[] when {prefix}aggregator=mean (the "
                              "method's own mean; choose one of byzfl's aggregators to pre-aggregate for)")
        for name, needs, default in (("bucket_size", "bucketing", 2), ("clip_threshold", "clipping", 2.0)):
            if getattr(self, name) != default and needs not in self.pre_aggregators:
                raise ConfigError(f"{prefix}{name}", getattr(self, name), f"{default} unless {prefix}pre_aggregators "
                                  f"has {needs} (the setting is its parameter)")
        needs_f = [name for name in (self.aggregator, *self.pre_aggregators) if takes_f(name, ())]
        if self.f == 0 and needs_f:
            raise ConfigError(f"{prefix}f", self.f, f"at least 1 with {needs_f[0]} (the hostile updates it tolerates: "
                              "with f = 0 krum keeps one update, trmean and nnm are the plain mean; set the hostile "
                              "nodes the defence must survive)")
        if self.f > 0 and not (self.krum_screen or takes_f(self.aggregator, self.pre_aggregators)):
            raise ConfigError(f"{prefix}f", self.f, f"0 unless {prefix}krum_screen is on or an aggregator or "
                              "pre-aggregator that takes f is configured (median, average, geometric_median, "
                              "centered_clipping, bucketing and clipping do not)")
        if self.krum_screen and self.f < 1:
            raise ConfigError(f"{prefix}f", self.f, f"at least 1 with {prefix}krum_screen (the updates it rejects)")
        if self.adaptive_clip_to != "bound" and self.adaptive_clip is None:
            raise ConfigError(f"{prefix}adaptive_clip_to", self.adaptive_clip_to,
                              f"'bound' when {prefix}adaptive_clip is null (set an adaptive_clip for the updates it "
                              "scales down to the median norm)")
        if self.refill != "none" and not any(self.on(name) for name in REJECTING):
            raise ConfigError(f"{prefix}refill", self.refill,
                              f"'none' when {', '.join(prefix + name for name in REJECTING)} are all off "
                              "(nothing is rejected, so no slot is refilled)")

    @property
    def stage_on(self) -> bool:
        """Whether the per-update stage does anything."""
        return any(self.on(name) for name in SWITCHES)

    def on(self, name: str) -> bool:
        """Whether the stage's setting ``name`` is on (not null, not false)."""
        value = getattr(self, name)
        return value is not None and value is not False


def _retired_robust_mean(how: str) -> dict[str, object]:
    """``robust_mean`` of a run made before byzfl's aggregators: none and median carry over;
    our trimmed mean cut a share of each coordinate's values, which no fixed ``f`` is."""
    if how == "none":
        return {}
    if how == "median":
        return {"aggregator": "median"}
    raise ConfigError("strategy.defence.robust_mean", how, "none or median (retired: byzfl's aggregators replaced it; "
                      "for the trimmed mean set strategy.defence.aggregator=trmean with strategy.defence.f = the values "
                      "left out at each end, the run's trim_fraction × clients_per_round rounded down)")


#: The stage's settings that reject updates, and all that turn it on (null: off).
REJECTING = ("screen", "sign_screen", "norm_screen", "class_screen", "krum_screen")
SWITCHES = ("clip_update_norm", "adaptive_clip", *REJECTING)
#: The stage's settings (those acting on each update, before the method), and the mean's.
STAGE = (*SWITCHES, "adaptive_clip_to", "refill", "trust_root")
MEAN = ("aggregator", "pre_aggregators", "bucket_size", "clip_threshold")
#: What a method holds (:attr:`strategies.method.Method.holds`): one model sent to every node; a
#: model per node of the round (K models, model i to the i-th node); a model per client (SOLO).
ONE_MODEL, PER_NODE, PER_CLIENT = "one model", "a model per node", "a model per client"


def refused_settings(holds: str, secure: bool = False) -> dict[str, str]:
    """The settings that have no meaning for a method that holds ``holds`` (with secure
    recombination when ``secure``), each with why: {setting: why}."""
    if holds == PER_CLIENT:
        return dict.fromkeys((*STAGE, *MEAN), "each client trains only its own model and nothing is aggregated into "
                             "anyone else's, so a hostile client harms only itself")
    refused: dict[str, str] = {}
    if secure:
        refused.update(dict.fromkeys(STAGE, "with strategy.secure.enabled=true each upload is recombined from layers of "
                                     "other clients' models, not an update of the model the server sent that node; "
                                     "the aggregator still applies"))
    if holds == ONE_MODEL:
        refused.setdefault("refill", "the method takes one mean of the kept updates, which a rejected node is simply "
                                     "left out of; refill is for a method that keeps a model per node")
    return refused


def refuse(defence: DefenceSettings, refused: Mapping[str, str], method: str) -> None:
    """A :class:`ConfigError` for the first setting ``refused`` names that is not its default."""
    defaults = DefenceSettings()
    for name, why in refused.items():
        value = getattr(defence, name)
        if value != getattr(defaults, name):
            raise ConfigError(f"strategy.defence.{name}", value,
                              f"{getattr(defaults, name)!r} with strategy={method} ({why})".replace("None", "null"))


def defend(defence: DefenceSettings, updates: list[ClientUpdate], sent: Sequence[Mapping[str, np.ndarray]],
           names: list[str], rejected: list[str], round_log: dict[str, float],
           verdicts: list[Verdict] | None = None) -> tuple[list[ClientUpdate], list[ClientUpdate]]:
    """The stage (:meth:`Defence.screen_and_bound`) on a round's accepted ``updates``
    (``sent[i]``: the model ``updates[i]`` was sent, ``names[i]``: how logs name its node): the
    updates kept, and the stand-ins of the rejected ones (``refill``; not replies: the method
    puts their models in their slots and counts nothing else of them); each screened reply's
    reason goes into ``rejected``, the stage's numbers into ``round_log``, the verdict into
    ``verdicts`` (when given)."""
    verdict = Defence(defence).screen_and_bound(updates, sent)
    if verdicts is not None:
        verdicts.append(verdict)
    by_id = {id(u): name for u, name in zip(updates, names)}
    refilled = " (its slot takes the round's median update)" if verdict.stand_ins else ""
    rejected.extend(f"{by_id[id(u)]}: {reason}{refilled}" for u, reason in verdict.rejected)
    round_log.update(verdict.log)
    return verdict.kept, verdict.stand_ins


def _floating(model: Mapping[str, np.ndarray]) -> list[str]:
    return [k for k, v in model.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]


@dataclass
class Verdict:
    """What the stage did to a round's updates."""

    kept: list[ClientUpdate]
    rejected: list[tuple[ClientUpdate, str]] = field(default_factory=list)
    #: ``refill``: each rejected update's stand-in (its node and slot, its sent model plus the
    #: median of the kept updates, no metrics).
    stand_ins: list[ClientUpdate] = field(default_factory=list)
    log: dict[str, float] = field(default_factory=dict)
    #: What the screens measured of each update, in the order of the round's updates:
    #: ``cosine`` and ``sign_agreement`` (to the round's median update), ``norm_ratio`` (to the
    #: median norm), ``class_agreement`` (:func:`class_agreement`; NaN: not compared), each
    #: where its screen is on and the round has at least 3 updates.
    scores: dict[str, np.ndarray] = field(default_factory=dict)


def output_layer(deltas: list[dict[str, np.ndarray]], keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The updates of the output layer, the model's last 2-D floating entry ``<name>weight`` with
    its ``<name>bias``: rows ``[update, class, feature]`` and bias ``[update, class]``."""
    for key in reversed(keys):
        bias = key[: -len("weight")] + "bias" if key.endswith("weight") else None
        if deltas[0][key].ndim == 2 and bias in deltas[0] and deltas[0][bias].shape == deltas[0][key].shape[:1]:
            return np.stack([d[key] for d in deltas]), np.stack([d[bias] for d in deltas])
    raise ConfigError("strategy.defence.class_screen", "on", "null for a model without an output layer (a last 2-D "
                      f"'...weight' entry with its '...bias'; the model's floating entries: {', '.join(keys)})")


def check_model(defence: DefenceSettings, model: Mapping[str, np.ndarray]) -> None:
    """A :class:`ConfigError` before the first round when a setting cannot act on ``model``
    (``class_screen`` on a model without an output layer)."""
    if defence.class_screen is not None:
        keys = _floating(model)
        output_layer([{k: np.asarray(model[k]) for k in keys}], keys)


def class_agreement(rows: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Per update (``rows[i]``: its output-layer weight update, ``[class, feature]``; ``bias[i]``:
    its bias update): for each class k whose bias it raises, the cosine of its row k to the
    coordinate-wise median row k of the other updates that raise k, averaged weighted by how much
    it raises k; NaN where no other update raises any of its classes."""
    n, classes = bias.shape
    total, weight = np.zeros(n), np.zeros(n)
    for k in range(classes):
        raising = np.flatnonzero(bias[:, k] > 0)
        if len(raising) < 2:
            continue
        for i in raising:
            reference = np.median(rows[raising[raising != i], k], axis=0)
            scale = float(np.linalg.norm(rows[i, k]) * np.linalg.norm(reference))
            total[i] += bias[i, k] * (float(rows[i, k] @ reference) / scale if scale > 0 else 0.0)
            weight[i] += bias[i, k]
    return np.divide(total, weight, out=np.full(n, np.nan), where=weight > 0)


def krum_scores(deltas: list[dict[str, np.ndarray]], keys: list[str], f: int) -> np.ndarray | None:
    """Each update's Krum score (Blanchard et al., NeurIPS 2017): the sum of its squared
    distances to its n − f − 2 nearest other updates; None when the round has fewer than f + 3
    updates (no neighbour left to score by)."""
    n = len(deltas)
    if n < f + 3:
        return None
    gram = np.zeros((n, n))
    for k in keys:
        flat = np.stack([np.ravel(d[k]) for d in deltas])
        gram += flat @ flat.T
    sq = np.diag(gram)
    distances = np.maximum(sq[:, None] + sq[None, :] - 2 * gram, 0.0)
    np.fill_diagonal(distances, np.inf)
    return np.sort(distances, axis=1)[:, : n - f - 2].sum(axis=1)


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
        if any(s.on(name) for name in REJECTING) and len(updates) >= 3:
            self._screen(updates, deltas, norms, keys, keep, verdict)
        bound = target = np.inf
        if s.clip_update_norm is not None:
            bound = target = float(s.clip_update_norm)
        if s.adaptive_clip is not None and keep.any():
            median = float(np.median(norms[keep]))
            if s.adaptive_clip * median < bound:
                bound = s.adaptive_clip * median
                target = median if s.adaptive_clip_to == "median" else bound
            verdict.log["update_norm_bound"] = bound
        scaled = 0
        for i, update in enumerate(updates):
            if not keep[i]:
                continue
            if norms[i] > bound and norms[i] > 0:
                scale = target / norms[i]
                for k in keys:
                    deltas[i][k] *= scale
                update.model = self._moved(update.model, sent[i], deltas[i], keys)
                scaled += 1
            verdict.kept.append(update)
        if np.isfinite(bound):
            verdict.log["updates_scaled"] = float(scaled)
        if s.refill == "median" and verdict.rejected and keep.any():
            median = {k: np.median(np.stack([deltas[i][k] for i in np.flatnonzero(keep)]), axis=0) for k in keys}
            index = {id(u): i for i, u in enumerate(updates)}
            for update, _ in verdict.rejected:
                i = index[id(update)]
                verdict.stand_ins.append(ClientUpdate(update.node_id, update.slot,
                                                      self._moved(update.model, sent[i], median, keys), 0.0, {}))
        return verdict

    def _screen(self, updates: list[ClientUpdate], deltas: list[dict[str, np.ndarray]], norms: np.ndarray,
                keys: list[str], keep: np.ndarray, verdict: Verdict) -> None:
        """``screen``, ``sign_screen``, ``norm_screen`` and ``class_screen``: clear ``keep`` of
        each update rejected, with its reason in ``verdict``."""
        s = self.settings
        tests: list[tuple[str, np.ndarray, list[str]]] = []  # (setting, True where rejected, reasons)
        if s.screen is not None or s.sign_screen is not None:
            cosines, agreement = self._against_median(deltas, norms, keys)
            verdict.scores.update(cosine=cosines, sign_agreement=agreement)
            if s.screen is not None:
                verdict.log["smallest_cosine"] = float(cosines.min())
                tests.append(("screen", cosines <= s.screen, [f"cosine {c:.3f} to the round's median update is at most "
                                                              f"{s.screen:g}" for c in cosines]))
            if s.sign_screen is not None:
                verdict.log["smallest_sign_agreement"] = float(agreement.min())
                tests.append(("sign_screen", agreement <= s.sign_screen,
                              [f"sign agreement {a:.3f} with the round's median update is at most {s.sign_screen:g}"
                               for a in agreement]))
        if s.norm_screen is not None:
            ratio = norms / max(float(np.median(norms)), np.finfo(float).tiny)
            verdict.scores["norm_ratio"] = ratio
            verdict.log["largest_norm_ratio"] = float(ratio.max())
            tests.append(("norm_screen", ratio > s.norm_screen, [f"update norm {r:.3g}× the round's median is above "
                                                                 f"{s.norm_screen:g}×" for r in ratio]))
        if s.class_screen is not None:
            agreement = class_agreement(*output_layer(deltas, keys))
            verdict.scores["class_agreement"] = agreement
            if not np.isnan(agreement).all():
                verdict.log["smallest_class_agreement"] = float(np.nanmin(agreement))
            tests.append(("class_screen", agreement <= s.class_screen,  # NaN (nothing to compare) is kept
                          [f"class agreement {a:.3f} with the other updates raising its classes is at most "
                           f"{s.class_screen:g}" for a in agreement]))
        if s.krum_screen:
            scores = krum_scores(deltas, keys, s.f)
            if scores is not None:
                verdict.scores["krum_score"] = scores
                worst = np.zeros(len(deltas), bool)
                worst[np.argsort(scores, kind="stable")[len(deltas) - s.f:]] = True
                tests.append(("krum_screen", worst, [f"Krum score {v:.3g} is among the round's {s.f} largest (median "
                                                     f"{float(np.median(scores)):.3g})" for v in scores]))
        for name, out, reasons in tests:
            for i in np.flatnonzero(keep & out):
                keep[i] = False
                verdict.rejected.append((updates[i], f"defence.{name}: {reasons[i]}"))
        verdict.log["updates_screened"] = float((~keep).sum())

    @staticmethod
    def _moved(model: ModelDict, sent: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray],
               keys: list[str]) -> ModelDict:
        """``model`` with each floating entry replaced by ``sent + delta`` (in the entry's dtype)."""
        out = dict(model)
        for k in keys:
            out[k] = (np.asarray(sent[k], np.float64) + delta[k]).astype(np.asarray(model[k]).dtype)
        return out

    @staticmethod
    def _against_median(deltas: list[dict[str, np.ndarray]], norms: np.ndarray,
                        keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Each delta's cosine similarity to the coordinate-wise median delta (0 for a zero delta),
        and its share of the coordinates where the median is not 0 that have the median's sign."""
        dots, agree = np.zeros(len(deltas)), np.zeros(len(deltas))
        median_sq, counted = 0.0, 0
        for k in keys:
            median = np.median(np.stack([d[k] for d in deltas]), axis=0)
            median_sq += float(np.vdot(median, median))
            dots += [float(np.vdot(d[k], median)) for d in deltas]
            sign, nonzero = np.sign(median), median != 0
            counted += int(nonzero.sum())
            agree += [float(np.count_nonzero(np.sign(d[k])[nonzero] == sign[nonzero])) for d in deltas]
        scale = norms * np.sqrt(median_sq)
        cosines = np.divide(dots, scale, out=np.zeros_like(dots), where=scale > 0)
        return cosines, agree / counted if counted else np.zeros_like(agree)
