"""Central, client-level differential privacy for every method that can have it (docs/privacy.md).

A stage of every round's end (:func:`strategies.rounds.end`), as the defence stage is, so no
method can skip it:

1. **Clip** each accepted update (its floating entries minus those of the model its node was
   sent, BatchNorm's running statistics included) to L2 norm ≤ C (``clip_norm``); integer entries
   (BatchNorm's batch counters, which count a client's data) take the sent model's values.
   With ``clipping: client`` the clients clip (Flower's ``fixedclipping_mod``, which reads the
   ``clipping_norm`` every train message then carries) and the server checks the norm instead:
   an update above C is rejected (a client without the mod cannot spend the guarantee).
2. **Noise** every model the server releases, by what the method releases
   (``releases``, which a method declares beside its aggregate: :func:`strategies.contract.release_of`):

   - ``"mean"`` (FedAvg, FedProx, FedRL, MOON and every one-model method whose next model is the
     mean of the round's updates): the mean of m clipped updates changes by at most 2C/m when one
     client's data is replaced, so the aggregate gets N(0, (z·2C/m)²) per coordinate, z the
     ``noise_multiplier``; the mean is unweighted (example counts would let one client weigh
     more). A server optimizer steps from the noised mean (post-processing).
   - ``"models"`` (FedMR, FedCross, FedMut): the method keeps G models (``groups``; null: G = K,
     one client per model), the i-th selected node is sent model i mod G, and the clients sent
     the same model form a group; the release is each group's clipped mean, noised with
     N(0, (z·2C/m_g)²) for the m_g updates of the group that came back (:func:`group_releases`).
     Each client is in exactly one group, so the G releases are one Gaussian mechanism of
     multiplier z (parallel composition); every later model is a permutation, fusion or
     mutation of them: post-processing. G = K is one client's model per release, noised with
     z·2C. A group with fewer than ``min_group_size`` updates back is not released that round.
   - ``refused("why")``: refused under DP, with the method's reason; a method that declares
     nothing is refused too, naming the declaration to add.

3. **Account** each round as one sampled Gaussian release with Flower's RDP accountant
   (``flwr.serverapp``'s :class:`PrivacyConfig` / :class:`GaussianPrivacyEvent` on Google's
   dp-accounting): m = K of N clients drawn without replacement, neighbours by replacing one
   client. The draw must be secret for the sampling to amplify privacy: under DP the uniform
   selector draws from a seed of the operating system's (kept in the checkpoint, so a resumed run
   goes on exactly) instead of the run's seed, unless ``sampling: public`` (then no
   amplification is accounted). ε at δ is in every round's ``metrics.jsonl`` row and in
   ``summary.json``; with ``max_epsilon`` the run ends before the round that would exceed it.

The server is the trusted curator: the guarantee covers the models it sends, evaluates and
saves; what it logs (train loss, rejections) is its operator's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Choice, Int, Nullable, Number, Settings, setting

#: The train-config key of the clipping norm that Flower's clipping mods read.
CLIPPING_NORM_KEY = "clipping_norm"
#: How far above C a client-clipped update may be (float32 rounding of the mod's own clipping).
CLIENT_CLIP_TOLERANCE = 1e-4
#: The ratio of the noise's norm on a release to C above which a run is warned that it will hardly
#: learn (measured: FedAvg, lenet, 100:10, 50 rounds learned to 45 % at 45×, 18 % at 80×; the
#: example of docs/privacy.md, 100 of 1,000 clients, learns to about 60 % at ~5×).
UNLIKELY = 50


@dataclass
class PrivacySettings(Settings):
    """Central, client-level differential privacy (off by default: ``clip_norm`` null):
    each update clipped against the model its node was sent, Gaussian noise on every model the
    server releases, Flower's RDP accountant (docs/privacy.md)."""

    keyed = False
    clip_norm: float | None = setting(None, Nullable(Number(gt=0), "null (off) or an L2 norm > 0"),
                                      "C: each update (model − the model it was sent) clipped to this L2 norm; "
                                      "null: no differential privacy", label="DP C {}")
    noise_multiplier: float = setting(1.0, Number(gt=0), "z: the noise's standard deviation over the release's "
                                      "sensitivity (2C/m on a mean of m updates, 2C on each model of a "
                                      "multi-model method)", label="z {}")
    delta: float | None = setting(None, Nullable(Number(gt=0, lt=1), "null (1/N^1.1) or a probability in (0, 1)"),
                                  "δ at which ε is reported (null: 1/N^1.1, N = num_clients; δ >= 1/N is warned "
                                  "about: it allows a whole client's data to leak with that probability)")
    max_epsilon: float | None = setting(None, Nullable(Number(gt=0), "null (no limit) or an ε > 0"),
                                        "end the run cleanly before the round that would take ε above this")
    clipping: str = setting("server", Choice("server", "client"),
                            "server: the server clips each update | client: the clients clip (Flower's "
                            "fixedclipping_mod; every train message carries clipping_norm) and the server "
                            "rejects an update above C")
    groups: int | None = setting(None, Nullable(Int(min=1), "null (K: one client per model) or an integer >= 1"),
                                 "G: with a multi-model method (releases models), the models it keeps and the "
                                 "disjoint groups of the round's clients (the i-th selected to group i mod G), each "
                                 "group's clipped mean released with noise z·2C/m_g; null: G = K, each model one "
                                 "client's, noised with z·2C", label="{} DP groups")
    min_group_size: int = setting(1, Int(min=1), "the fewest clients a release may average: K // G selected per group "
                                  "at least this many (checked before the first round), and a group with fewer "
                                  "updates back is not released that round (its model stays as sent)")
    sampling: str = setting("secret", Choice("secret", "public"),
                            "secret: the uniform selector draws from a seed of the operating system's, so the "
                            "draw amplifies privacy (sampling without replacement accounted) | public: the "
                            "run's seed draws (reproducible, no amplification accounted)")

    @property
    def enabled(self) -> bool:
        return self.clip_norm is not None

    def check_values(self, prefix: str) -> None:
        """The other settings need ``clip_norm`` (DP on)."""
        if self.enabled:
            return
        defaults = PrivacySettings()
        for name in ("noise_multiplier", "delta", "max_epsilon", "clipping", "sampling", "groups", "min_group_size"):
            if getattr(self, name) != getattr(defaults, name):
                raise ConfigError(f"{prefix}{name}", getattr(self, name), f"{getattr(defaults, name)!r} while "
                                  f"{prefix}clip_norm is null (differential privacy is off)".replace("None", "null"))

    def target_delta(self, population: int) -> float:
        return float(self.delta) if self.delta is not None else 1.0 / population ** 1.1

    def models_kept(self, sample: int) -> int:
        """How many models a multi-model method keeps for K = ``sample`` clients a round: G under
        grouped releases, else K (one per selected client)."""
        return int(self.groups) if self.enabled and self.groups is not None else int(sample)


#: The neutral value of a run made before privacy was a setting.
OFF = PrivacySettings().to_dict()


#: What differential privacy refuses with any method: (the setting, why); a method's own refusal
#: is its declaration (``releases``, :func:`strategies.contract.release_refusal`).
REFUSED_WITH = (
    ("`strategy.asynchronous.enabled=true`", "an asynchronous round's jobs are not a sample of K of N clients drawn "
     "without replacement, which the accounting assumes"),
    ("a `selection` other than `uniform`", "the accounting assumes K of N clients drawn uniformly without replacement; "
     "this selector's draw depends on the clients' data"),
    ("`strategy.secure.enabled=true`", "an upload is recombined from other clients' layers, so no update can be clipped "
     "against the model its node was sent"),
    ("any `strategy.defence` setting", "screens and robust aggregators choose updates by their values, which changes the "
     "sensitivity the noise is calibrated to; DP's clipping already bounds each update"),
)


def check_privacy(strategy_settings: Any, run: Any) -> None:
    """The rules of DP across the run's settings: what the method releases, and
    :data:`REFUSED_WITH` (its driver, the selector, secure recombination, the defence settings);
    δ against N (a warning)."""
    p = strategy_settings.privacy
    if not p.enabled:
        return
    from logging import WARNING

    from flwr.supercore import log

    from strategies.contract import release_of, release_refusal
    from strategies.defence import DefenceSettings

    key, value = "strategy.privacy.clip_norm", p.clip_norm
    method = getattr(type(strategy_settings), "strategy_class", None)
    name = strategy_settings.option
    asynchronous, selection, secure, defence = (why for _, why in REFUSED_WITH)
    if strategy_settings.asynchronous.enabled:
        raise ConfigError(key, value, f"null with strategy={name} and strategy.asynchronous.enabled=true ({asynchronous})")
    if method is not None and release_refusal(method):
        raise ConfigError(key, value, f"null with strategy={name} ({release_refusal(method)})")
    if strategy_settings.driver == "secure":
        raise ConfigError(key, value, f"null with strategy.secure.enabled=true ({secure})")
    if run.selection.name != "uniform":
        raise ConfigError(key, value, f"null with selection={run.selection.name} ({selection})")
    defaults = DefenceSettings()
    changed = [n for n in defaults.to_dict() if getattr(strategy_settings.defence, n) != getattr(defaults, n)]
    if changed:
        raise ConfigError(f"strategy.defence.{changed[0]}", getattr(strategy_settings.defence, changed[0]),
                          f"its default with strategy.privacy.clip_norm set ({defence})")
    check_groups(p, str(release_of(method)) if method is not None else "", run.clients_per_round, name)
    if p.target_delta(run.num_clients) >= 1.0 / run.num_clients:
        log(WARNING, "strategy.privacy.delta=%g is at least 1/num_clients (1/%d): with that probability the "
            "guarantee allows one client's whole data to leak; choose δ well below 1/N", p.target_delta(run.num_clients),
            run.num_clients)


def check_groups(p: PrivacySettings, releases: str, sample: int, name: str) -> None:
    """``groups`` and ``min_group_size`` against what the method releases and K = ``sample``:
    groups only for a method that releases its models, G ≤ K, and K // G ≥ ``min_group_size``
    (the smallest group when every selected client answers; the mean's one group is all K)."""
    key = "strategy.privacy.groups"
    if p.groups is not None and releases != "models":
        raise ConfigError(key, p.groups, f"null with strategy={name} (it releases the mean of the round's updates: one "
                          "group of all of them; groups divide the clients of a method that releases its models)")
    groups = p.models_kept(sample) if releases == "models" else 1
    if groups > sample:
        raise ConfigError(key, p.groups, f"at most clients_per_round={sample} (each group needs a client)")
    if sample // groups < p.min_group_size:
        raise ConfigError("strategy.privacy.min_group_size", p.min_group_size,
                          f"at most {sample // groups}: clients_per_round={sample} in {groups} group(s) of "
                          f"strategy={name} leaves {sample // groups} client(s) in the smallest; lower it"
                          + (f", or set {key} to at most {sample // p.min_group_size}" if releases == "models" else ""))


def floating(model: Mapping[str, np.ndarray]) -> list[str]:
    return [k for k, v in model.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]


def update_norm(model: Mapping[str, np.ndarray], sent: Mapping[str, np.ndarray]) -> float:
    """L2 norm of ``model − sent`` over the floating entries (float64)."""
    return math.sqrt(sum(float(np.sum((np.asarray(model[k], np.float64) - np.asarray(sent[k], np.float64)) ** 2))
                         for k in floating(sent)))


def clipped(update: ClientUpdate, clip: float) -> ModelDict:
    """``update``'s model with its update clipped to L2 ≤ ``clip`` against ``update.sent``;
    integer entries take the sent model's values."""
    sent = update.sent
    assert sent is not None
    norm = update_norm(update.model, sent)
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    out: ModelDict = {}
    for key, value in update.model.items():
        base = np.asarray(sent[key])
        if np.issubdtype(base.dtype, np.floating):
            out[key] = (base.astype(np.float64) + scale * (np.asarray(value, np.float64) - base)).astype(base.dtype)
        else:
            out[key] = base
    return out


def noised(model: Mapping[str, np.ndarray], std: float, rng: np.random.Generator) -> ModelDict:
    """``model`` with N(0, std²) added to every floating coordinate (in the entry's dtype)."""
    out: ModelDict = {}
    for key, value in model.items():
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.floating):
            out[key] = (value.astype(np.float64) + rng.normal(0.0, std, value.shape)).astype(value.dtype)
        else:
            out[key] = value
    return out


def group_releases(updates: list[ClientUpdate], groups: int, min_size: int, std: Any,
                   rng: np.random.Generator) -> tuple[list[ClientUpdate], list[int]]:
    """The releases of a multi-model method: the clipped ``updates`` of a round in ``groups``
    disjoint groups (the update of slot s in group s mod G, the model its node was sent), each
    group's unweighted mean noised with N(0, std(m_g)²) per floating coordinate, m_g the group's
    updates that came back. Returns (one update per released group, its ``slot`` the group's
    model; the groups withheld: fewer than ``min_size`` updates back).

    Parallel composition needs each client in exactly one group: a node counted twice (in two
    groups, or twice in one) is refused with a ValueError, as is a group whose members were sent
    different models."""
    members: dict[int, list[ClientUpdate]] = {}
    seen: dict[int, int] = {}
    for update in updates:
        group = update.slot % groups
        if update.node_id in seen:
            raise ValueError(f"node {update.node_id} is counted in group {seen[update.node_id]} and in group {group}: "
                             "parallel composition needs each client in exactly one group (a client's update in two "
                             "releases doubles its sensitivity)")
        seen[update.node_id] = group
        members.setdefault(group, []).append(update)
    released, withheld = [], []
    for group in range(groups):
        part = members.get(group, [])
        if len(part) < max(1, min_size):
            withheld.append(group)
            continue
        sent = part[0].sent
        if any(u.sent is not sent for u in part):
            raise ValueError(f"the updates of group {group} were sent different models: a group is the clients sent one "
                             "model")
        mean = {k: np.mean([np.asarray(u.model[k], np.float64) for u in part], axis=0) for k in floating(sent)}
        model = {k: (mean[k].astype(np.asarray(v).dtype) if k in mean else v) for k, v in part[0].model.items()}
        one = part[0] if len(part) == 1 else None
        released.append(ClientUpdate(one.node_id if one else -1, group, noised(model, std(len(part)), rng),
                                     sum(u.num_examples for u in part), dict(one.metrics) if one else {},
                                     sent=sent))
    return released, withheld


class Privacy:
    """The DP stage and accountant of one run (module docstring).

    Parameters
    ----------
    settings : PrivacySettings
        ``strategy.privacy`` (enabled).
    population : int
        N: the clients the round's K are drawn from.
    sample : int
        K: clients selected per round.
    releases : str
        What the method releases: ``"mean"`` or ``"models"``.
    """

    def __init__(self, settings: PrivacySettings, population: int, sample: int, releases: str) -> None:
        from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, SamplingMethod

        if releases not in ("mean", "models"):
            raise ValueError(f"releases {releases!r}; allowed: mean, models")
        self.settings, self.population, self.sample, self.releases = settings, int(population), int(sample), releases
        #: G: the groups of a models release (1 for a mean: every update in one), and the fewest
        #: updates a group holds when every selected client answers.
        self.groups = settings.models_kept(self.sample) if releases == "models" else 1
        self.group_size = self.sample // self.groups
        self.delta = settings.target_delta(self.population)
        sampling = SamplingMethod.WITHOUT_REPLACEMENT if settings.sampling == "secret" else SamplingMethod.NO_AMPLIFICATION
        relation = NeighboringRelation.REPLACE_ONE if settings.sampling == "secret" else NeighboringRelation.ADD_OR_REMOVE_ONE
        self.config = PrivacyConfig(target_delta=self.delta, population_size=self.population, neighboring_relation=relation,
                                    sampling_method=sampling, max_epsilon=settings.max_epsilon)
        self.event = GaussianPrivacyEvent(noise_multiplier=float(settings.noise_multiplier), sample_size=self.sample,
                                          population_size=self.population)
        self.accountant = self._accountant()
        #: Why the run stopped early (``max_epsilon``), or "".
        self.stopped = ""
        self.selector: Any = None
        self.last: dict[str, float] = {}
        #: The noise's norm on a release over C, once known (:meth:`tell`).
        self.ratio = 0.0
        #: The noise's generator: the operating system's entropy, kept in the checkpoint.
        self.seed = int(np.random.SeedSequence().entropy % (2**63))
        self.rng = np.random.default_rng(self.seed)

    @classmethod
    def attach(cls, context: Any) -> Privacy | None:
        """The DP stages' part of a run (its :class:`~strategies.context.RunContext`) when its
        method's settings turn it on, else None; with secret sampling its uniform selector draws
        from the part's seed. A method that does not declare what it releases is refused."""
        from strategies.contract import release_of, release_refusal

        method = context.method
        settings = method.settings.privacy
        if not settings.enabled:
            return None
        if release_refusal(type(method)):
            raise ValueError(f"{type(method).__name__} refuses differential privacy: {release_refusal(type(method))}")
        if method.num_clients is None:
            raise ValueError("differential privacy accounts the draw of K of N clients: give num_clients (N)")
        privacy = cls(settings, method.num_clients, method.clients_per_round, str(release_of(type(method))))
        privacy.selector = context.selector
        privacy._draw_secretly()
        return privacy

    def _draw_secretly(self) -> None:
        """With secret sampling, the uniform selector draws from a seed derived from the stage's."""
        if self.settings.sampling == "secret" and self.selector is not None and hasattr(self.selector, "seed"):
            self.selector.seed = int(np.random.SeedSequence([self.seed, 0x5A3]).generate_state(1)[0])

    def spent(self, server_round: int) -> bool:
        """Before round ``server_round``: True (and the reason kept in :attr:`stopped`) when its
        release would take ε above ``max_epsilon``."""
        from logging import WARNING

        from flwr.supercore import log

        if not self._would_exceed():
            return False
        self.stopped = (f"the privacy budget: round {server_round} would take ε above max_epsilon="
                        f"{self.settings.max_epsilon:g} at δ={self.delta:.3g} (ε so far {self.epsilon:.4g} after "
                        f"{self.accountant.num_releases} rounds)")
        log(WARNING, "stopped before %s", self.stopped)
        return True

    def _accountant(self) -> Any:
        from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

        try:
            return RdpAccountant(self.config)
        except ImportError as err:  # pragma: no cover - flwr[dp] is a dependency
            raise ConfigError("strategy.privacy.clip_norm", self.settings.clip_norm, "null, or install flwr[dp] "
                              "(Google's dp-accounting) for the accountant") from err

    @property
    def clip(self) -> float:
        return float(self.settings.clip_norm)

    def stage(self, updates: list[ClientUpdate], rejected: list[str], names: list[str]) -> list[ClientUpdate]:
        """Clip (or, with client clipping, check) every update against its sent model (a
        multi-model release is noised afterwards, group by group: :func:`group_releases`).
        Returns the updates kept (a client-clipped update above C is rejected with its reason in
        ``rejected``)."""
        kept = []
        norms = [update_norm(u.model, u.sent) for u in updates]
        #: The round's update norms against C (how to choose C: docs/privacy.md).
        self.last = {"dp_update_norm_median": float(np.median(norms)) if norms else 0.0,
                     "dp_clipped_share": float(np.mean([n > self.clip for n in norms])) if norms else 0.0}
        for update, name in zip(updates, names):
            if self.settings.clipping == "client":
                norm = update_norm(update.model, update.sent)
                if norm > self.clip * (1 + CLIENT_CLIP_TOLERANCE):
                    rejected.append(f"{name}: privacy: update norm {norm:.4g} is above clip_norm {self.clip:g} "
                                    "(the client did not clip: fixedclipping_mod)")
                    continue
            update.model = clipped(update, self.clip)
            kept.append(update)
        return kept

    def noise_norm(self, dimension: int) -> float:
        """The expected L2 norm of the noise on one release of a model of ``dimension`` floating
        coordinates, when every sampled client's update came back (z·2C/K per coordinate on a
        mean, z·2C/(K // G) on the smallest group's model of a multi-model method)."""
        return self.noise_std(self.group_size) * math.sqrt(dimension)

    def non_finite_hint(self) -> str:
        """What a reply rejected for NaN/Inf under DP is told: the noise is the likely cause."""
        return (f" (under differential privacy the likely cause is the noise on the model this client was sent: "
                f"{self.ratio:.0f}× clip_norm={self.clip:g}; docs/privacy.md, 'Choosing C and z')"
                if self.ratio else " (under differential privacy the likely cause is the noise on the model it was sent)")

    def tell(self, dimension: int) -> None:
        """Log, before the first round, the noise's norm on what the method releases against C,
        and warn when it makes learning unlikely (:data:`UNLIKELY`)."""
        from logging import INFO, WARNING

        from flwr.supercore import log

        self.ratio = self.noise_norm(dimension) / self.clip
        what = f"the mean of {self.sample} updates" if self.releases == "mean" else "each released model" + (
            f" (the mean of a group of at least {self.group_size})" if self.group_size > 1 else "")
        log(INFO, "differential privacy: the noise on %s has norm ~%.3g, %.1f× clip_norm=%g (z=%g, %d coordinates)",
            what, self.noise_norm(dimension), self.ratio, self.clip, self.settings.noise_multiplier, dimension)
        if self.ratio > UNLIKELY:
            log(WARNING, "differential privacy: the noise on %s is %.0f× the clipping norm C=%g, above %d×: every "
                "round's signal (at most C) is buried under it, and the model is unlikely to learn. More clients per "
                "round, a smaller model, or a larger ε lower it (docs/privacy.md, 'Choosing C and z')",
                what, self.ratio, self.clip, UNLIKELY)

    def train_config(self) -> dict[str, float]:
        """What every train message carries: with client clipping, the norm the clients' mod clips to."""
        return {CLIPPING_NORM_KEY: self.clip} if self.settings.clipping == "client" else {}

    def noise_std(self, m: int) -> float:
        """The noise's standard deviation on a release whose sensitivity is 2C/m."""
        return float(self.settings.noise_multiplier) * 2.0 * self.clip / max(1, m)

    def release(self, model: ModelDict, m: int) -> ModelDict:
        """A one-model method's aggregate of m updates, noised (``"mean"``)."""
        return noised(model, self.noise_std(m), self.rng)

    def account(self) -> float:
        """Compose the round's release; ε at δ so far."""
        self.accountant.compose(self.event)
        return self.epsilon

    @property
    def epsilon(self) -> float:
        return float(self.accountant.get_epsilon(self.delta)) if self.accountant.num_releases else 0.0

    def _would_exceed(self) -> bool:
        """Whether the next round's release would take ε above ``max_epsilon``."""
        return self.settings.max_epsilon is not None and bool(self.accountant.would_exceed(self.event))

    def summary(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "delta": self.delta, "rounds_accounted": int(self.accountant.num_releases),
                "noise_multiplier": float(self.settings.noise_multiplier), "clip_norm": self.clip,
                "sample": self.sample, "population": self.population, "sampling": self.settings.sampling,
                **({"groups": self.groups} if self.releases == "models" else {}),
                "accounting": f"RDP, {self.config.sampling_method.value}, {self.config.neighboring_relation.value}"}

    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state_dict(), "rng": self.rng.bit_generator.state, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accountant.load_state_dict(dict(state["accountant"]))
        self.rng.bit_generator.state = state["rng"]
        self.seed = int(state["seed"])
        self._draw_secretly()


def noise_multiplier_for(epsilon: float, delta: float, rounds: int, sample: int, population: int,
                         sampling: str = "secret") -> float:
    """The smallest z (to 1e-3 relative) whose ``rounds`` releases stay within ε at δ: a binary
    search over Flower's accountant (``python -m analysis.privacy_budget``)."""
    from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, SamplingMethod
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    method = SamplingMethod.WITHOUT_REPLACEMENT if sampling == "secret" else SamplingMethod.NO_AMPLIFICATION
    relation = NeighboringRelation.REPLACE_ONE if sampling == "secret" else NeighboringRelation.ADD_OR_REMOVE_ONE
    config = PrivacyConfig(target_delta=delta, population_size=population, neighboring_relation=relation,
                           sampling_method=method)

    def eps(z: float) -> float:
        accountant = RdpAccountant(config)
        accountant.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=sample, population_size=population), rounds)
        return float(accountant.get_epsilon(delta))

    low, high = 1e-3, 1.0
    while eps(high) > epsilon:
        high *= 2
        if high > 1e4:
            raise ValueError(f"no noise multiplier below 1e4 reaches ε={epsilon} at δ={delta} in {rounds} rounds")
    while (high - low) / high > 1e-3:
        mid = (low + high) / 2
        low, high = (low, mid) if eps(mid) <= epsilon else (mid, high)
    return high
