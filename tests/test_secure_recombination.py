"""FedMR's secure recombination: cryptography, the four stages, Lemma 4.4 after the exchange,
all-or-nothing rollback on failures, rejection of tampered / replayed ciphertexts, and a server
that never sees a plaintext layer. The nodes are the real ClientApp handlers
(:func:`client_app.secure.handle`) behind an in-process grid; local training is replaced by a
known shift so that every trained layer can be traced."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from client_app import secure as client_secure
from fedmm import protocol, secure_protocol
from fedmm.observers import RunObserver
from fedmm.secure import RETURN, SEND, Envelope, LayerCodec, NodeExchange, SecureError, keypair, open_sealed, pair_key, seal
from strategies.fedmr import FedMR
from strategies.secure_recombination import SecureRecombination
from tests.fakes import FakeGrid

RUN_CONFIG = {"seed": 0, "objective": {"name": "ce"}}


def initial_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "conv.weight": rng.normal(size=(3, 2, 2)).astype(np.float32),
        "conv.bias": rng.normal(size=3).astype(np.float32),
        "bn.running_mean": rng.normal(size=3).astype(np.float32),
        "bn.num_batches_tracked": np.array(5, dtype=np.int64),
        "fc.weight": rng.normal(size=(4, 3)).astype(np.float32),
        "fc.bias": rng.normal(size=4).astype(np.float32),
    }


class Nodes:
    """The round's clients: real secure handlers, each with its own Context; "training" adds a
    node-specific random shift to every float array (and counts one more batch)."""

    def __init__(self, grid_keys: dict[int, str], fail: dict[tuple[str, str], str] | None = None) -> None:
        self.contexts = {
            key: Context(run_id=0, node_id=node, node_config={"partition-id": i}, state=RecordDict(), run_config={})
            for i, (node, key) in enumerate(sorted(grid_keys.items(), key=lambda kv: kv[1]))
        }
        self.fail = dict(fail or {})  # (node key, action) -> "error" | "silent"
        self.trained_from: dict[str, dict[str, np.ndarray]] = {}
        self.trained: dict[str, dict[str, np.ndarray]] = {}
        self.handled: list[tuple[str, str]] = []

    def train(self, cfg, context, server_round, model):  # noqa: ANN001, ANN201
        key = next(k for k, c in self.contexts.items() if c is context)
        rng = np.random.default_rng(hash((key, server_round)) % 2**32)
        out = {k: (v + rng.normal(size=v.shape).astype(v.dtype) if v.dtype.kind == "f" else v + 1) for k, v in model.items()}
        self.trained_from[key], self.trained[key] = dict(model), out
        return out, {"num-examples": 10.0, "train_loss": 0.5}

    def __call__(self, msg: Message, key: str) -> RecordDict:
        action = msg.metadata.message_type.partition(".")[2]
        self.handled.append((key, action))
        how = self.fail.pop((key, action), None)
        if how == "error":
            raise RuntimeError(f"node {key} crashed in {action}")
        reply = client_secure.handle(msg, self.contexts[key], self.train)
        if how == "silent":  # the reply is lost (a timeout, for the server)
            raise TimeoutError(f"node {key} timed out in {action}")
        return reply.content


def run_secure_round(mode: str, num_nodes: int = 5, seed: int = 1, fail=None, **secure_kwargs):  # noqa: ANN001, ANN201
    """One FedMR round with secure recombination on a fake grid; returns (strategy, grid, nodes)."""
    secure = SecureRecombination(mode=mode, **{"repetitions": 2, "min_layers": 1, **secure_kwargs})
    uploads = Uploads()
    strategy = FedMR(clients_per_round=num_nodes, seed=seed, secure=secure, observers=[uploads])
    strategy._test_uploads = uploads.by_node
    holder: dict[str, Nodes] = {}
    grid = RecordingGrid(lambda msg, key: holder["nodes"](msg, key), num_nodes=num_nodes, seed=seed)
    nodes = holder["nodes"] = Nodes(grid.keys, fail)
    # distinct dispatched models: the server's K models differ after a few FedMR rounds
    rng = np.random.default_rng(seed)
    base = initial_model()
    strategy.initialize(base)
    strategy.models = [{k: (v + rng.normal(size=v.shape).astype(v.dtype) if v.dtype.kind == "f" else v) for k, v in base.items()} for _ in range(num_nodes)]
    strategy.global_model = base
    config = ConfigRecord({protocol.RUN_CONFIG: json.dumps(RUN_CONFIG)})
    strategy.context.driver.run(1, grid, protocol.model_to_record(base), config, timeout=10)
    return strategy, grid, nodes


def layer_bytes(model: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {key: np.ascontiguousarray(value).tobytes() for key, value in model.items()}


def multiset(models) -> dict[str, Counter]:  # noqa: ANN001
    out: dict[str, Counter] = {}
    for model in models:
        for key, raw in layer_bytes(model).items():
            out.setdefault(key, Counter())[raw] += 1
    return out


class RecordingGrid(FakeGrid):
    """Keeps every reply the server pulled."""

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        out = super().pull_messages(message_ids)
        self.__dict__.setdefault("replies", []).extend(out)
        return out


class Uploads(RunObserver):
    """A copy of every upload the method aggregates, by node (the strategy moves them into its
    pool and recombines them)."""

    def __init__(self) -> None:
        self.by_node: dict[int, dict[str, np.ndarray]] = {}

    def on_aggregate(self, server_round, updates):  # noqa: ANN001, ANN201
        for update in updates:
            self.by_node[update.node_id] = {k: np.array(v) for k, v in update.model.items()}


# ============================================================================ cryptography
def test_seal_opens_only_for_its_envelope() -> None:
    a_private, a_public = keypair()
    b_private, b_public = keypair()
    _, c_public = keypair()
    key_ab = pair_key(a_private, b_public, run_id=3, server_round=2, a="11", b="22")
    assert key_ab == pair_key(b_private, a_public, run_id=3, server_round=2, a="22", b="11")  # both ends agree
    assert key_ab != pair_key(a_private, b_public, run_id=3, server_round=3, a="11", b="22")  # bound to the round
    assert key_ab != pair_key(a_private, b_public, run_id=4, server_round=2, a="11", b="22")  # and to the run
    assert key_ab != pair_key(a_private, c_public, run_id=3, server_round=2, a="11", b="33")
    envelope = Envelope(3, 2, "after", 0, 1, SEND, "11", "22", 0)
    ciphertext = seal(key_ab, envelope, b"layer bytes")
    assert open_sealed(key_ab, envelope, ciphertext) == b"layer bytes"
    assert len(ciphertext) == len(b"layer bytes") + 16
    changed = [
        Envelope(3, 2, "after", 0, 2, SEND, "11", "22", 0),  # replayed into the next repetition
        Envelope(3, 2, "after", 0, 1, RETURN, "11", "22", 0),  # into another stage
        Envelope(3, 2, "after", 0, 1, SEND, "11", "22", 1),  # reordered
        Envelope(3, 2, "after", 1, 1, SEND, "11", "22", 0),  # into a retry
        Envelope(3, 2, "before", 0, 1, SEND, "11", "22", 0),  # into the other exchange
        Envelope(3, 2, "after", 0, 1, SEND, "22", "11", 0),  # reflected back
    ]
    for other in changed:
        with pytest.raises(SecureError, match="failed authentication"):
            open_sealed(key_ab, other, ciphertext)
    tampered = bytearray(ciphertext)
    tampered[3] ^= 1
    with pytest.raises(SecureError, match="tampered"):
        open_sealed(key_ab, envelope, bytes(tampered))
    # nonces differ whenever anything but the key's pair differs
    nonces = {e.nonce() for e in [envelope, *changed]}
    assert len(nonces) == 1 + len(changed)


def test_layer_codec_pads_to_one_size() -> None:
    model = initial_model()
    spec = protocol.array_spec(model)
    units = [[k] for k in model]
    plain, padded = LayerCodec(spec, units, pad=False), LayerCodec(spec, units, pad=True)
    assert len({plain.wire_bytes(i) for i in range(len(units))}) > 1
    assert len({padded.wire_bytes(i) for i in range(len(units))}) == 1
    for codec in (plain, padded):
        for index, key in enumerate(model):
            back_index, arrays = codec.decode(codec.encode(index, model))
            assert back_index == index and arrays[key].tobytes() == model[key].tobytes()
            assert arrays[key].dtype == model[key].dtype
    assert padded.padding_bytes(0) == 0 and padded.padding_bytes(3) == 48 - 8  # fc.weight is the largest
    with pytest.raises(SecureError, match="out of range"):
        plain.decode(b"\x00\x00\x00\x09\x00\x00\x00\x00")


# ============================================================================ the stages
def test_four_stages_keep_every_layer_once() -> None:
    """Three nodes by hand: after stage 4 the layers of every index are a permutation of theirs."""
    models = [{k: v + i for k, v in initial_model().items()} for i in range(3)]
    codec = LayerCodec(protocol.array_spec(models[0]), [[k] for k in models[0]], pad=False)
    nodes = [NodeExchange.start(5, 1, str(100 + i), m) for i, m in enumerate(models)]
    peers = {n.node: n.public for n in nodes}
    for node in nodes:
        node.begin("after", 0, peers)
    for repetition in (1, 2, 3):
        outbox = {n.node: n.send(repetition, 2, 4, codec) for n in nodes}
        inbox = {n.node: [(src, seq, ct) for src, out in outbox.items() for dst, seq, ct in out if dst == n.node] for n in nodes}
        returns = {n.node: n.receive_and_return(inbox[n.node], codec) for n in nodes}
        for n in nodes:
            n.assemble([(src, seq, ct) for src, out in returns.items() for dst, seq, ct in out if dst == n.node], codec)
    assert multiset(n.model for n in nodes) == multiset(models)
    assert any(layer_bytes(n.model) != layer_bytes(m) for n, m in zip(nodes, models))


def test_node_refuses_steps_out_of_order() -> None:
    node = NodeExchange.start(0, 1, "7", initial_model())
    node.advance(10, "stage 1")
    with pytest.raises(SecureError, match="does not follow"):
        node.advance(10, "stage 1 again")  # a replayed message would reuse nonces
    with pytest.raises(SecureError, match="not among"):
        node.begin("after", 0, {"8": keypair()[1]})  # its own key is missing: keys were swapped


# ============================================================================ rounds
@pytest.mark.parametrize("mode", ["after", "before", "both"])
def test_round_keeps_every_trained_layer_in_exactly_one_upload(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The nodes draw from the operating system (secrets); with so few layers a round can leave every
    # layer with its owner by chance, so the draws are made reproducible here, and layers move.
    monkeypatch.setattr("fedmm.secure.secrets.randbits", random.Random(3).getrandbits)
    strategy, grid, nodes = run_secure_round(mode)
    uploads = strategy._test_uploads
    assert len(uploads) == 5 and strategy.context.last_round.replies == 5
    keys_by_node = grid.keys
    uploaded = {keys_by_node[node]: model for node, model in uploads.items()}
    if mode in ("after", "both"):
        # Lemma 4.4: the uploads hold every trained layer exactly once (bytes equal, so sums too)
        assert multiset(uploaded.values()) == multiset(nodes.trained.values())
        moved = sum(layer_bytes(uploaded[k])[name] != layer_bytes(nodes.trained[k])[name] for k in uploaded for name in uploaded[k])
        assert moved > 0  # layers did change hands
    if mode in ("before", "both"):
        # the models trained are a recombination of the dispatched ones
        assert multiset(nodes.trained_from.values()) == multiset(secure_dispatched(strategy).values())
    if mode == "before":
        assert all(layer_bytes(uploaded[k]) == layer_bytes(nodes.trained[k]) for k in uploaded)
    totals = {key: sum(m[key].astype(np.float64) for m in uploaded.values()) for key in uploaded[next(iter(uploaded))]}
    expected = {key: sum(m[key].astype(np.float64) for m in nodes.trained.values()) for key in totals}
    for key in totals:
        np.testing.assert_array_equal(totals[key], expected[key])
    log = strategy.round_log
    assert log["secure_exchanged"] == 1.0 and log["secure_dropped"] == 0.0
    exchanges = 2 if mode == "both" else 1
    assert log["secure_round_trips"] == exchanges * (2 * 2) + 2  # 2·r_s per exchange, keys, upload


def secure_dispatched(strategy: FedMR) -> dict[int, dict[str, np.ndarray]]:
    assert strategy.settings.secure.enabled
    return strategy.context.driver.relay.dispatched


def test_server_never_sees_a_plaintext_layer() -> None:
    """Every payload the server relayed or received during the exchange: none equals or contains
    the bytes of any layer a client trained (or was dispatched, in the before exchange)."""
    strategy, grid, nodes = run_secure_round("both", num_nodes=4)
    secret = set()
    for model in [*nodes.trained.values(), *nodes.trained_from.values()]:
        for value in model.values():
            raw = np.ascontiguousarray(value).tobytes()
            if len(raw) >= 12:  # 8-byte scalars could match by chance; every float layer here is longer
                secret.add(raw)
    relayed = []
    for msg in grid.sent:
        if secure_protocol.SECURE_IN in msg.content:
            relayed.extend(protocol.decode_array(a).tobytes() for a in msg.content[secure_protocol.SECURE_IN].values())
    for reply in grid.replies:
        action = reply.metadata.message_type.partition(".")[2]
        if action != secure_protocol.SECURE_UPLOAD:  # before the upload no reply carries a model
            assert protocol.ARRAYS not in reply.content
        if secure_protocol.SECURE_OUT in reply.content:
            relayed.extend(protocol.decode_array(a).tobytes() for a in reply.content[secure_protocol.SECURE_OUT].values())
    assert len(relayed) > 10
    for payload in relayed:
        for raw in secret:
            assert raw not in payload
    # the uploads themselves are the recombined models (the protocol's point), not a trainer's whole model
    uploads = {grid.keys[n]: m for n, m in strategy._test_uploads.items()}
    assert any(layer_bytes(uploads[k]) != layer_bytes(nodes.trained[k]) for k in uploads)


@pytest.mark.parametrize(("action", "how"), [("secure_send", "error"), ("secure_return", "silent"), ("secure_upload", "error")])
def test_failure_rolls_back_and_loses_nothing(action: str, how: str) -> None:
    """A node failing in any phase of the exchange after training: everybody else rolls back,
    the exchange is retried without it; the uploads are the other nodes' trained layers, each once."""
    probe_strategy, probe_grid, _ = run_secure_round("after", num_nodes=5)
    victim = sorted(probe_grid.keys.values())[2]
    strategy, grid, nodes = run_secure_round("after", num_nodes=5, fail={(victim, action): how})
    uploads = {grid.keys[n]: m for n, m in strategy._test_uploads.items()}
    survivors = {k: m for k, m in nodes.trained.items() if k != victim}
    assert victim not in uploads and len(uploads) == 4
    assert multiset(uploads.values()) == multiset(survivors.values())
    assert strategy.round_log["secure_dropped"] == 1.0
    assert strategy.round_log["secure_attempts"] == 2.0 and strategy.round_log["secure_exchanged"] == 1.0
    assert any("dropped from secure recombination" in r for r in strategy.context.last_round.rejections)
    # the victim's slot keeps the model it was dispatched (plain FedMR's rule for a failed node)
    victim_node = next(n for n, k in grid.keys.items() if k == victim)
    assert victim_node in strategy.context.driver.relay.dispatched


def test_exchange_gives_up_after_max_attempts_and_uploads_the_snapshots() -> None:
    keys = sorted(FakeGrid(lambda m, k: RecordDict(), 3, seed=1).keys.values())
    fail = {(keys[0], "secure_send"): "error", (keys[1], "secure_return"): "error"}
    strategy, grid, nodes = run_secure_round("after", num_nodes=3, fail=fail, max_attempts=2)
    uploads = {grid.keys[n]: m for n, m in strategy._test_uploads.items()}
    assert list(uploads) == [keys[2]]
    assert layer_bytes(uploads[keys[2]]) == layer_bytes(nodes.trained[keys[2]])  # its own, rolled back
    assert strategy.round_log["secure_exchanged"] == 0.0


def test_tampered_and_replayed_ciphertexts_are_rejected_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay that flips a bit, or replays a ciphertext of an earlier repetition: the receiving
    node refuses it (logged as its error), the repetition rolls back for everyone."""
    from strategies import secure_recombination as server

    original = server.SecureRecombination._route
    seen: dict[str, object] = {}

    def tampering_route(self, rnd, replies, participants, exchange, attempt, repetition, stage, expected):  # noqa: ANN001, ANN202
        routed = original(self, rnd, replies, participants, exchange, attempt, repetition, stage, expected)
        if routed and attempt == 0 and stage == SEND and repetition == 1:
            dst, items = next((d, i) for d, i in routed.items() if i)
            src, seq, array = items[0]
            seen["first"] = (dst, src, seq, array)
            raw = bytearray(protocol.decode_array(array).tobytes())
            raw[-1] ^= 0x01
            items[0] = (src, seq, protocol.encode_array(np.frombuffer(bytes(raw), dtype=np.uint8)))
        return routed

    monkeypatch.setattr(server.SecureRecombination, "_route", tampering_route)
    strategy, grid, nodes = run_secure_round("after", num_nodes=4)
    assert any("failed authentication" in reason and "tampered" in reason for reason in strategy.context.last_round.rejections)
    uploads = {grid.keys[n]: m for n, m in strategy._test_uploads.items()}
    # the receiver and the sender it names were dropped (the relay cannot tell which one lies),
    # the retry completed without them
    assert len(uploads) == 2
    dropped = {grid.keys[seen["first"][0]], grid.keys[int(seen["first"][1])]}
    assert multiset(uploads.values()) == multiset(m for k, m in nodes.trained.items() if k not in dropped)

    # replay: the first sealed layer of repetition 1 delivered again in repetition 2
    def replaying_route(self, rnd, replies, participants, exchange, attempt, repetition, stage, expected):  # noqa: ANN001, ANN202
        routed = original(self, rnd, replies, participants, exchange, attempt, repetition, stage, expected)
        if routed and attempt == 0 and stage == SEND:
            if repetition == 1:
                dst, items = next((d, i) for d, i in routed.items() if i)
                seen["replay"] = (dst, items[0])
            elif repetition == 2:
                dst, item = seen["replay"]
                routed[dst] = [item, *[i for i in routed[dst] if (i[0], i[1]) != (item[0], item[1])]]
        return routed

    monkeypatch.setattr(server.SecureRecombination, "_route", replaying_route)
    strategy, grid, nodes = run_secure_round("after", num_nodes=4)
    assert any("failed authentication" in reason for reason in strategy.context.last_round.rejections)
    assert strategy.round_log["secure_dropped"] >= 1.0
    uploads = {grid.keys[n]: m for n, m in strategy._test_uploads.items()}
    dropped = {k for k in nodes.trained if k not in uploads}
    assert multiset(uploads.values()) == multiset(m for k, m in nodes.trained.items() if k not in dropped)


def test_state_survives_serialization_between_messages() -> None:
    model = initial_model()
    node = NodeExchange.start(1, 2, "9", model)
    node.buffers = {0: [{"conv.weight": model["conv.weight"] * 2}], 3: []}
    node.sent = [("4", 3)]
    node.snapshot = dict(model)
    state = node.to_state()
    back = NodeExchange.from_state(state["meta"], state["private"], state["arrays"])
    assert back.private == node.private and back.public == node.public and back.sent == node.sent
    assert set(back.buffers) == {0, 3} and back.buffers[3] == []
    np.testing.assert_array_equal(back.buffers[0][0]["conv.weight"], model["conv.weight"] * 2)
    assert layer_bytes(back.model) == layer_bytes(model) and layer_bytes(back.snapshot) == layer_bytes(model)


def test_config_and_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="mode"):
        SecureRecombination(mode="sometimes")
    with pytest.raises(ValueError, match="min_layers=3, max_layers=2"):
        SecureRecombination(min_layers=3, max_layers=2)
    assert SecureRecombination(max_layers=None).layer_bounds(6) == (1, 3)
    assert SecureRecombination(min_layers=4, max_layers=9).layer_bounds(6) == (4, 6)


# ============================================================================ the linkage attack (bench/secure_linkage.py)
def _linkage():  # noqa: ANN202
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "secure_linkage.py"
    spec = importlib.util.spec_from_file_location("secure_linkage", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_linkage_routing_matrix_by_hand() -> None:
    """Node 0 sends its layer to node 1: node 1 returns one of {its own, node 0's} at random."""
    linkage = _linkage()
    matrix = linkage._repetition_matrix([(0, 1, 1.0)], 3)
    np.testing.assert_allclose(matrix, [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    # 0 → 2 and 1 → 2: node 2's buffer holds three layers, one stays, one goes back to each sender
    matrix = linkage._repetition_matrix([(0, 2, 1.0), (1, 2, 1.0)], 3)
    np.testing.assert_allclose(matrix, np.full((3, 3), 1 / 3))
    # an edge that carries the index with probability 1/2 (sizes do not tell): a mixture
    half = linkage._repetition_matrix([(0, 1, 0.5)], 2)
    np.testing.assert_allclose(half.sum(axis=1), 1.0)
    assert half[0, 0] > 0.5 > half[0, 1] > 0


def test_linkage_attack_on_real_rounds() -> None:
    """The attack runs on what the server saw: rows of every routing matrix sum to 1; without an
    exchange after training, the uploader is the trainer (the attack is always right); the
    ground truth maps every uploaded layer to exactly one trained layer."""
    linkage = _linkage()
    for mode in ("before", "after"):
        strategy, grid, nodes = run_secure_round(mode, num_nodes=4)
        uploads = strategy._test_uploads
        trained = {next(n for n, k in grid.keys.items() if k == key): m for key, m in nodes.trained.items()}
        units = [[k] for k in initial_model()]
        codec = LayerCodec(protocol.array_spec(initial_model()), units, pad=False)
        sizes = [codec.wire_bytes(j) for j in range(len(units))]
        truth = linkage.true_trainers(uploads, trained, units)
        guess = linkage.attribute(mode, uploads, strategy.context.driver.relay.dispatched, strategy.context.driver.relay.trace, units, sizes)
        assert set(truth) <= set(guess) and len(truth) == 4 * (len(units) - 1)  # the counter is alike everywhere
        for matrix in linkage.routing_matrices(strategy.context.driver.relay.trace, mode, sorted(strategy.context.driver.relay.dispatched), sizes):
            np.testing.assert_allclose(matrix.sum(axis=1), 1.0)
        if mode == "before":
            assert all(guess[key] == truth[key] for key in truth)
        else:
            assert any(truth[(u, j)] != u for u, j in truth)  # layers moved after training


def test_padding_hides_sizes_and_no_reply_tells_them() -> None:
    strategy, grid, nodes = run_secure_round("after", num_nodes=4, pad=True, max_layers=6)
    assert len({relay.nbytes for relay in strategy.context.driver.relay.trace}) == 1  # every ciphertext one size
    uploads = {grid.keys[n]: m for n, m in strategy._test_uploads.items()}
    assert multiset(uploads.values()) == multiset(nodes.trained.values())
    # no reply carries what the padding hides (a node's count of padding bytes would give the
    # real sizes of the layers it sealed)
    for reply in grid.replies:
        for record in reply.content.metric_records.values():
            assert not any("padding" in key for key in record), dict(record)
    plain, _, _ = run_secure_round("after", num_nodes=4, pad=False, max_layers=6)
    assert len({relay.nbytes for relay in plain.context.driver.relay.trace}) > 1  # sizes name the layers
