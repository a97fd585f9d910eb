"""Tests aimed at three mutations the rest of the suite let through: a pair key derived from the
public keys only, client handlers that skip the step-order (nonce-reuse) check, and SCAFFOLD's
correction with its sign reversed. Each was planted once and failed here."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from client_app.training import sgd_steps
from fedmm import protocol, secure_protocol
from fedmm.secure import PROTOCOL_LABEL, SecureError, keypair, pair_key


def test_the_pair_key_is_hkdf_of_the_x25519_secret_which_needs_a_private_key() -> None:
    a_private, a_public = keypair()
    b_private, b_public = keypair()
    key = pair_key(a_private, b_public, 3, 7, "11", "5")
    assert key == pair_key(b_private, a_public, 3, 7, "5", "11")  # both ends agree
    # the documented construction: HKDF-SHA256 over X25519(a, B), salt SHA-256(run|round), info label|low|high
    shared = X25519PrivateKey.from_private_bytes(a_private).exchange(X25519PublicKey.from_public_bytes(b_public))
    expected = HKDF(algorithm=hashes.SHA256(), length=32, salt=hashlib.sha256(b"3|7").digest(),
                    info=PROTOCOL_LABEL + b"|5|11").derive(shared)
    assert key == expected
    # the server relays both public keys: nothing made of them alone gives the key
    for public_only in (a_public + b_public, b_public + a_public, bytes(x ^ y for x, y in zip(a_public, b_public))):
        guess = HKDF(algorithm=hashes.SHA256(), length=32, salt=hashlib.sha256(b"3|7").digest(),
                     info=PROTOCOL_LABEL + b"|5|11").derive(public_only)
        assert guess != key
    # another private key with the same public peer: another key
    c_private, _ = keypair()
    assert pair_key(c_private, b_public, 3, 7, "11", "5") != key


@pytest.mark.parametrize("replayed", [secure_protocol.SECURE_SEND, secure_protocol.SECURE_RETURN, secure_protocol.SECURE_UPLOAD])
def test_the_client_refuses_a_replayed_secure_message(replayed: str) -> None:
    """A replayed (or reordered) message would make the node seal again with nonces it used:
    the client's handler refuses every secure action that does not follow the last one."""
    from client_app import secure as client_secure
    from tests.test_secure_recombination import run_secure_round

    strategy, grid, nodes = run_secure_round("after", num_nodes=4)
    sent = [m for m in grid.sent if m.metadata.message_type.partition(".")[2] == replayed]
    assert sent
    msg = sent[0]
    key = grid.keys[msg.metadata.dst_node_id]
    with pytest.raises(SecureError, match="does not follow"):
        client_secure.handle(msg, nodes.contexts[key], nodes.train)


def test_scaffold_step_adds_c_minus_c_i_to_the_gradient() -> None:
    """One SCAFFOLD step by hand: w1 = w0 − lr·(∇f(w0) + c − c_i), momentum 0."""
    from flwr.app import RecordDict

    from objectives.scaffold import CONTROL, CONTROL_STATE, Scaffold
    from fedmm.training import TrainingSettings

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    c = {n: np.full(tuple(p.shape), 0.5, np.float32) for n, p in model.named_parameters()}
    ci = {n: np.full(tuple(p.shape), 0.2, np.float32) for n, p in model.named_parameters()}
    state = RecordDict({CONTROL_STATE: protocol.model_to_record(ci)})
    from flwr.app import MetricRecord

    from objectives.scaffold import CONTROL_AGE_STATE

    state[CONTROL_AGE_STATE] = MetricRecord({"rounds": 1})
    run = {"objective": {"name": "scaffold", "momentum": 0.0, "clip_norm": None, "control_lr": "used"},
           "training": TrainingSettings(lr=0.1, momentum=0.0).to_dict(), "strategy": {"name": "scaffold"}}
    update = Scaffold(run, state, RecordDict({CONTROL: protocol.model_to_record(c)}))
    update.state = state  # keep the stored c_i (own_state would clear another experiment's)
    update.own_state = lambda: None
    update.begin(model, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    sgd_steps(model, update, optimizer, [(x, y)])
    for (name, p), g in zip(model.named_parameters(), grads):
        expected = w0[name] - 0.1 * (g + 0.5 - 0.2)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)


def test_a_received_layer_with_nan_is_refused_naming_its_sender() -> None:
    from fedmm.secure import BAD_LAYER_FROM, LayerCodec, NodeExchange, seal

    codec = LayerCodec({"w": ((2,), np.dtype(np.float32))}, [["w"]], pad=False)
    with pytest.raises(SecureError, match="NaN"):
        codec.decode(codec.encode(0, {"w": np.array([1.0, np.nan], np.float32)}))
    # at a node: the error names the sender, which the relay drops along with the receiver
    a_private, a_public = keypair()
    node = NodeExchange.start(1, 1, "5", {"w": np.zeros(2, np.float32)})
    node.begin("after", 0, {"5": node.public, "9": a_public})
    node.repetition, node.phase = 1, "sent"
    envelope = node.envelope(1, "9", "5", 0)
    ciphertext = seal(pair_key(a_private, node.public, 1, 1, "9", "5"), envelope,
                      codec.encode(0, {"w": np.array([np.inf, 0.0], np.float32)}))
    with pytest.raises(SecureError, match=BAD_LAYER_FROM + "9"):
        node._open_all([("9", 0, ciphertext)], 1, codec)
