"""FLTrust's rule (Cao et al., NDSS 2021, Algorithm 2): each update judged against the server's own.

The server holds a small clean *root set* that no client trains on (``strategy.defence.trust_root``
rows of the test split: a change of threat model, the server holds data; docs/defences.md). Each
round it trains, from the model a node was sent, the reference update g₀ on that set, with the
clients' local training; then for each update gᵢ (the node's model minus the model it was sent)

- the trust score TSᵢ = ReLU(cos(gᵢ, g₀)) (eq. 3): an update pointing away from the reference
  counts for nothing, however large;
- the rescaled update ĝᵢ = ‖g₀‖ / ‖gᵢ‖ · gᵢ (eq. 4): no update is longer than the reference;
- the aggregate g = Σ TSᵢ ĝᵢ / Σ TSᵢ (eq. 5), nothing when every score is 0.

One model is sent per node here: FedAvg and SCAFFOLD send every node the same model, FedMR and
FedCross a model per node, so the reference is trained once per distinct sent model and each
update is judged against the reference of the model it was sent.

The round's end is a list of stages and the method takes its own mean afterwards (FedAvg's
example-weighted one, SCAFFOLD's plain one, the multi-model methods' K models). So the stage
(:func:`trusted`) hands on each kept update in its *equal-mean form* ĝ'ᵢ = m · TSᵢ / Σ TSⱼ · ĝᵢ
(m: the updates kept, those with TSᵢ > 0) and the weighting stage weighs the updates equally
while trust is on: the plain mean of the ĝ'ᵢ is eq. 5 exactly, whichever method takes it. An
update with TSᵢ = 0 is rejected (its weight in eq. 5 is 0), with the cosine as its reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from fedmm.protocol import ClientUpdate, ModelDict

#: The server's training on its root set: (the model a node was sent, the round) → the model trained from it.
ReferenceTrainer = Callable[[ModelDict, int], ModelDict]


def trust_scores(deltas: Sequence[np.ndarray], references: Sequence[np.ndarray]) -> np.ndarray:
    """TSᵢ = ReLU(cos(gᵢ, g₀ᵢ)) for each update ``deltas[i]`` and its reference ``references[i]``
    (flat vectors; a zero vector has cosine 0)."""
    scores = np.zeros(len(deltas))
    for i, (g, g0) in enumerate(zip(deltas, references)):
        scale = float(np.linalg.norm(g) * np.linalg.norm(g0))
        scores[i] = max(0.0, float(np.vdot(g, g0)) / scale) if scale > 0 else 0.0
    return scores


def rescaled(deltas: Sequence[np.ndarray], references: Sequence[np.ndarray]) -> list[np.ndarray]:
    """ĝᵢ = ‖g₀ᵢ‖ / ‖gᵢ‖ · gᵢ (a zero update stays zero)."""
    out = []
    for g, g0 in zip(deltas, references):
        norm = float(np.linalg.norm(g))
        out.append(g * (float(np.linalg.norm(g0)) / norm) if norm > 0 else np.zeros_like(g))
    return out


def fltrust(deltas: Sequence[np.ndarray], reference: np.ndarray) -> np.ndarray:
    """The paper's aggregate of ``deltas`` against one reference g₀: Σ TSᵢ ĝᵢ / Σ TSᵢ (zeros
    when every score is 0)."""
    references = [reference] * len(deltas)
    scores = trust_scores(deltas, references)
    if scores.sum() <= 0:
        return np.zeros_like(reference)
    return sum(s * g for s, g in zip(scores, rescaled(deltas, references))) / scores.sum()


def equal_mean_form(scores: np.ndarray, updates: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each update with a score > 0 as m · TSᵢ / Σ TSⱼ · ĝᵢ (m of them): their plain mean is
    Σ TSᵢ ĝᵢ / Σ TSᵢ (module docstring)."""
    kept = np.flatnonzero(scores > 0)
    total = float(scores[kept].sum())
    return [updates[i] * (len(kept) * scores[i] / total) for i in kept]


def _flat(model: Mapping[str, np.ndarray], keys: list[str]) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(model[k], np.float64)) for k in keys])


def trusted(updates: list[ClientUpdate], train_reference: ReferenceTrainer, server_round: int, names: list[str],
            rejected: list[str], round_log: dict[str, float]) -> list[ClientUpdate]:
    """The stage on a round's ``updates`` (each with the model it was sent, ``update.sent``):
    the kept ones, each model moved to its sent model plus its equal-mean form; each rejected
    reply's reason (``names[i]``: how logs name its node) into ``rejected``, the stage's numbers
    into ``round_log``."""
    keys = [k for k, v in updates[0].model.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]
    references: dict[int, np.ndarray] = {}  # one reference per distinct sent model
    for u in updates:
        if id(u.sent) not in references:
            references[id(u.sent)] = _flat(train_reference(u.sent, server_round), keys) - _flat(u.sent, keys)
    deltas = [_flat(u.model, keys) - _flat(u.sent, keys) for u in updates]
    g0 = [references[id(u.sent)] for u in updates]
    scores = trust_scores(deltas, g0)
    round_log.update(smallest_trust=float(scores.min()), updates_distrusted=float((scores <= 0).sum()),
                     reference_norm=float(np.median([np.linalg.norm(g) for g in g0])))
    moved = iter(equal_mean_form(scores, rescaled(deltas, g0)))
    kept = []
    for update, name, score, g, ref in zip(updates, names, scores, deltas, g0):
        if score <= 0:
            cosine = float(np.vdot(g, ref) / max(float(np.linalg.norm(g) * np.linalg.norm(ref)), np.finfo(float).tiny))
            rejected.append(f"{name}: defence.trust_root: cosine {cosine:.3f} to the server's reference update is not "
                            "above 0 (trust score 0)")
            continue
        update.model = _moved(update.model, update.sent, next(moved), keys)
        kept.append(update)
    return kept


def _moved(model: ModelDict, sent: Mapping[str, np.ndarray], delta: np.ndarray, keys: list[str]) -> ModelDict:
    """``model`` with each floating entry replaced by ``sent`` plus its part of the flat ``delta``."""
    out, start = dict(model), 0
    for k in keys:
        base = np.asarray(sent[k])
        out[k] = (base.astype(np.float64) + delta[start:start + base.size].reshape(base.shape)).astype(np.asarray(model[k]).dtype)
        start += base.size
    return out
