"""FedMR's secure recombination: the cryptography and one node's side of the protocol.

Before they upload (or before they train, or both), the round's clients swap layers among
themselves so that the server cannot tell which client trained which layer (FedMR, Algorithm 2
of the arXiv version). Clients never talk directly: the server relays every layer, sealed end to
end between the two clients. One *repetition* has four stages:

1. **send**: draw n uniformly from [n_l, n_u]; seal n distinct layers of the model, each to a peer
   drawn uniformly from the other participants, and take them out of their buffers;
2. **receive**: open what arrives and put each layer into the buffer of its index, remembering
   ⟨sender, index⟩;
3. **return**: for each remembered ⟨sender, index⟩ take a random element of that index's buffer
   (the node's own layer, the sender's or a third client's) and seal it back to the sender;
4. **assemble**: open the returned layers; every buffer now holds exactly one layer: the model.

Cryptography (the ``cryptography`` package): an ephemeral X25519 key pair per node and round;
pairwise keys from HKDF-SHA256 over the X25519 secret, salted with the run and round and bound to
the (unordered) pair; ChaCha20-Poly1305 with a deterministic nonce (direction, exchange, attempt,
repetition, stage, sequence number) and the associated data (run, round, exchange, attempt,
repetition, stage, sender, receiver, sequence number). A node only ever moves forward through the
round's steps (:func:`step_number`), so a nonce is never used twice under one key, and a
ciphertext the server replays, reorders or redirects fails authentication.

The threat model (honest-but-curious server, public keys relayed unsigned) and what the protocol
hides and does not hide: docs/secure_recombination.md.

This module needs numpy and ``cryptography`` only; the ClientApp's message handlers are in
:mod:`client_app.secure`, the server's phases in :mod:`strategies.secure_recombination`.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

#: Bound into every key and associated data (a ciphertext of another protocol never opens).
PROTOCOL_LABEL = b"fedmm/secure-recombination/v1"
#: When the clients exchange layers: before local training, after it (before upload), or both.
MODES = ("before", "after", "both")
#: The exchanges of a round, in order.
EXCHANGES = ("before", "after")
#: Stages that seal: 1 (send) and 3 (return).
SEND, RETURN = 1, 3
#: Bytes ChaCha20-Poly1305 adds to every plaintext.
TAG_BYTES = 16
#: Plaintext header: layer index, payload length.
HEADER = struct.Struct(">II")
#: Largest repetition number and attempt number a step can carry.
MAX_REPETITIONS = 4000
MAX_ATTEMPTS = 255


#: How a node's error names the peer whose sealed layer it could not use (the relay reads it).
BAD_LAYER_FROM = "the layer from node "


class SecureError(RuntimeError):
    """A violation of the protocol: a ciphertext that does not open, a message out of order, a
    count that does not balance. The node refuses the message; the server rolls back."""


def exchanges_of(mode: str) -> tuple[str, ...]:
    """The exchanges a mode runs, in order."""
    if mode not in MODES:
        raise ValueError(f"secure recombination mode={mode!r}; allowed: {', '.join(MODES)}")
    return EXCHANGES if mode == "both" else (mode,)


def step_number(exchange: str, attempt: int, repetition: int, stage: int) -> int:
    """The position of a message in a round: strictly increasing over the messages a node gets.

    Key setup is step 0; within an exchange and attempt, repetition r's stage 1 (send) and stage
    2 (return) follow each other; the upload closing an attempt is stage 3 of repetition
    ``MAX_REPETITIONS + 1``, so a retry (attempt + 1) comes after it.
    """
    if not 0 <= attempt <= MAX_ATTEMPTS:
        raise SecureError(f"attempt {attempt} out of range 0..{MAX_ATTEMPTS}")
    if not 0 <= repetition <= MAX_REPETITIONS + 1:
        raise SecureError(f"repetition {repetition} out of range 0..{MAX_REPETITIONS}")
    return 1 + ((EXCHANGES.index(exchange) * (MAX_ATTEMPTS + 1) + attempt) * (MAX_REPETITIONS + 2) + repetition) * 4 + stage


def upload_step(exchange: str, attempt: int) -> int:
    """The step of the upload that closes ``attempt`` of ``exchange``."""
    return step_number(exchange, attempt, MAX_REPETITIONS + 1, 3)


# ============================================================================ cryptography
def keypair() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair: (private, public), 32 raw bytes each."""
    private = X25519PrivateKey.generate()
    return private.private_bytes_raw(), private.public_key().public_bytes_raw()


def pair_key(private: bytes, peer_public: bytes, run_id: int, server_round: int, a: str, b: str) -> bytes:
    """The 32-byte key nodes ``a`` and ``b`` share in this run and round.

    HKDF-SHA256 over their X25519 secret; salt = SHA-256(run ‖ round), info = the protocol label
    ‖ the two node ids in ascending order. Raises SecureError for a malformed public key.
    """
    try:
        shared = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as err:
        raise SecureError(f"no key agreement with node {b if a != b else a}: {err}") from err
    salt = hashlib.sha256(b"%d|%d" % (int(run_id), int(server_round))).digest()
    low, high = sorted((int(a), int(b)))
    info = PROTOCOL_LABEL + b"|%d|%d" % (low, high)
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(shared)


@dataclass(frozen=True)
class Envelope:
    """Everything a ciphertext is bound to: its nonce and associated data are built from it."""

    run_id: int
    server_round: int
    exchange: str
    attempt: int
    repetition: int
    stage: int
    src: str
    dst: str
    seq: int

    def nonce(self) -> bytes:
        """12 bytes, unique per key: direction, exchange, attempt, repetition, stage, sequence."""
        direction = 0 if int(self.src) < int(self.dst) else 1
        return struct.pack(
            ">BBBHBIxx", direction, EXCHANGES.index(self.exchange), self.attempt, self.repetition, self.stage, self.seq
        )

    def associated_data(self) -> bytes:
        fields = [self.run_id, self.server_round, self.exchange, self.attempt, self.repetition, self.stage, self.src, self.dst, self.seq]
        return PROTOCOL_LABEL + b"|" + json.dumps(fields, separators=(",", ":")).encode()

    def describe(self) -> str:
        stage = {SEND: "send", RETURN: "return"}.get(self.stage, str(self.stage))
        return (
            f"from node {self.src} to node {self.dst} (round {self.server_round}, {self.exchange} exchange, "
            f"attempt {self.attempt}, repetition {self.repetition}, {stage} stage, sequence {self.seq})"
        )


def seal(key: bytes, envelope: Envelope, plaintext: bytes) -> bytes:
    """ChaCha20-Poly1305 of ``plaintext`` under ``key``, bound to ``envelope``."""
    return ChaCha20Poly1305(key).encrypt(envelope.nonce(), plaintext, envelope.associated_data())


def open_sealed(key: bytes, envelope: Envelope, ciphertext: bytes) -> bytes:
    """The plaintext of ``ciphertext``; SecureError when it was not sealed for ``envelope`` under
    ``key`` (tampered with, replayed, reordered or redirected)."""
    try:
        return ChaCha20Poly1305(key).decrypt(envelope.nonce(), ciphertext, envelope.associated_data())
    except InvalidTag as err:
        raise SecureError(
            f"ciphertext {envelope.describe()} failed authentication: tampered with, replayed, reordered or redirected"
        ) from err


# ============================================================================ layers
class LayerCodec:
    """Layers (units of a state_dict) as plaintexts: header (index, length), the raw bytes of the
    unit's arrays, and with ``pad`` zeros up to the largest unit, so that every ciphertext of the
    model has one size and does not reveal its index."""

    def __init__(self, spec: Mapping[str, tuple[tuple[int, ...], Any]], units: Sequence[Sequence[str]], pad: bool) -> None:
        self.spec = {key: (tuple(shape), np.dtype(dtype)) for key, (shape, dtype) in spec.items()}
        self.units = [list(unit) for unit in units]
        self.sizes = [sum(int(np.prod(self.spec[k][0], dtype=np.int64)) * self.spec[k][1].itemsize for k in unit) for unit in self.units]
        self.pad = bool(pad)
        self.padded = max(self.sizes) if self.sizes else 0

    def plaintext_bytes(self, index: int) -> int:
        return HEADER.size + (self.padded if self.pad else self.sizes[index])

    def wire_bytes(self, index: int) -> int:
        """Bytes of the ciphertext of layer ``index`` (as relayed, before Flower's framing)."""
        return self.plaintext_bytes(index) + TAG_BYTES

    def padding_bytes(self, index: int) -> int:
        return self.plaintext_bytes(index) - HEADER.size - self.sizes[index]

    def encode(self, index: int, model: Mapping[str, np.ndarray]) -> bytes:
        parts = []
        for key in self.units[index]:
            shape, dtype = self.spec[key]
            value = np.asarray(model[key], dtype=dtype)
            if tuple(value.shape) != shape:
                raise SecureError(f"layer {key}: shape {tuple(value.shape)} != {shape}")
            parts.append(value.tobytes())
        payload = b"".join(parts)
        padding = bytes(self.padded - len(payload)) if self.pad else b""
        return HEADER.pack(index, len(payload)) + payload + padding

    def decode(self, plaintext: bytes) -> tuple[int, dict[str, np.ndarray]]:
        if len(plaintext) < HEADER.size:
            raise SecureError(f"a plaintext of {len(plaintext)} bytes has no header")
        index, length = HEADER.unpack_from(plaintext)
        if index >= len(self.units):
            raise SecureError(f"layer index {index} out of range (the model has {len(self.units)} layers)")
        if length != self.sizes[index] or len(plaintext) != self.plaintext_bytes(index):
            raise SecureError(f"layer {index}: {len(plaintext)} bytes, expected {self.plaintext_bytes(index)}")
        arrays, offset = {}, HEADER.size
        for key in self.units[index]:
            shape, dtype = self.spec[key]
            count = int(np.prod(shape, dtype=np.int64))
            arrays[key] = np.frombuffer(plaintext, dtype=dtype, count=count, offset=offset).reshape(shape).copy()
            if np.issubdtype(arrays[key].dtype, np.floating) and not np.isfinite(arrays[key]).all():
                raise SecureError(f"layer {index}: {key} holds NaN or Inf")
            offset += count * dtype.itemsize
        return index, arrays


# ============================================================================ one node
Sealed = tuple[str, int, bytes]  # (peer, sequence number, ciphertext)


@dataclass
class NodeExchange:
    """One node's side of the round: its keys, its model, the buffers of the open repetition.

    The handlers of :mod:`client_app.secure` keep it in ``Context.state`` between messages
    (:meth:`to_state` / :meth:`from_state`). Randomness (how many layers, which layers, which
    peers, which buffer element goes back) comes from the operating system, never from the run's
    seed: the server knows the seed.
    """

    run_id: int
    server_round: int
    node: str
    private: bytes
    public: bytes
    model: dict[str, np.ndarray]
    step: int = 0
    exchange: str = ""
    attempt: int = -1
    repetition: int = 0
    #: "idle" | "sent" (stage 1 done) | "returned" (stage 3 done, returns awaited)
    phase: str = "idle"
    snapshot: dict[str, np.ndarray] | None = None
    peers: dict[str, bytes] = field(default_factory=dict)
    #: Stage 1: (receiver, layer index) of every layer sent; one layer comes back for each.
    sent: list[tuple[str, int]] = field(default_factory=list)
    #: Buf_l beyond the model: index -> the layers held for it (the model's own layer is in it
    #: unless it was sent).
    buffers: dict[int, list[dict[str, np.ndarray]]] = field(default_factory=dict)
    #: Training metrics, reported at upload.
    metrics: dict[str, float] = field(default_factory=dict)
    #: Ciphertext bytes this node sealed and opened this round, and the padding among them.
    bytes_sealed: int = 0
    padding_sealed: int = 0

    @classmethod
    def start(cls, run_id: int, server_round: int, node: str, model: dict[str, np.ndarray]) -> NodeExchange:
        private, public = keypair()
        return cls(run_id, server_round, node, private, public, dict(model))

    # ------------------------------------------------------------------ ordering
    def advance(self, step: int, what: str) -> None:
        """Refuse a message that does not come after the last one handled (a replayed or
        reordered message would make the node reuse a nonce)."""
        if step <= self.step:
            raise SecureError(f"node {self.node}: {what} (step {step}) does not follow step {self.step} of round {self.server_round}")
        self.step = step

    def envelope(self, stage: int, src: str, dst: str, seq: int) -> Envelope:
        return Envelope(self.run_id, self.server_round, self.exchange, self.attempt, self.repetition, stage, src, dst, seq)

    def key_with(self, peer: str) -> bytes:
        if peer not in self.peers or peer == self.node:
            raise SecureError(f"node {self.node}: node {peer} is not a peer of this exchange")
        return pair_key(self.private, self.peers[peer], self.run_id, self.server_round, self.node, peer)

    # ------------------------------------------------------------------ settle the last repetition
    def rollback(self) -> None:
        """Back to the model this exchange started from (nothing of it is kept)."""
        if self.snapshot is not None:
            self.model = dict(self.snapshot)
        self.sent, self.buffers, self.phase = [], {}, "idle"

    def assemble(self, incoming: Sequence[Sealed], codec: LayerCodec) -> None:
        """Stage 4: open the returned layers (one for every layer sent, from its receiver, of its
        index); every buffer then holds exactly one layer, which becomes the model's."""
        if self.phase != "returned":
            raise SecureError(f"node {self.node}: returned layers arrived but no repetition is open")
        expected: dict[tuple[str, int], int] = {}
        for dst, index in self.sent:
            expected[(dst, index)] = expected.get((dst, index), 0) + 1
        for src, index, layer in self._open_all(incoming, RETURN, codec):
            if expected.get((src, index), 0) < 1:
                raise SecureError(f"node {self.node}: node {src} returned layer {index}, which was not sent to it")
            expected[(src, index)] -= 1
            self.buffers.setdefault(index, []).append(layer)
        missing = [f"layer {index} from node {dst}" for (dst, index), count in expected.items() for _ in range(count)]
        if missing:
            raise SecureError(f"node {self.node}: returns missing: {', '.join(missing[:5])}")
        model = dict(self.model)
        for index, layers in self.buffers.items():
            if len(layers) != 1:
                raise SecureError(f"node {self.node}: buffer of layer {index} holds {len(layers)} layers after assembly, not 1")
            model.update(layers[0])
        self.model, self.sent, self.buffers, self.phase = model, [], {}, "idle"

    # ------------------------------------------------------------------ the stages
    def begin(self, exchange: str, attempt: int, peers: Mapping[str, bytes]) -> None:
        """First repetition of an attempt: take the snapshot rolled back to on failure."""
        if self.node not in peers or peers[self.node] != self.public:
            raise SecureError(f"node {self.node}: its own public key is not among the participants' keys")
        self.exchange, self.attempt, self.peers = exchange, attempt, dict(peers)
        self.snapshot = dict(self.model)

    def send(self, repetition: int, min_layers: int, max_layers: int, codec: LayerCodec) -> list[Sealed]:
        """Stage 1: seal n random layers, each to a random other participant."""
        if self.phase != "idle":
            raise SecureError(f"node {self.node}: stage 1 while a repetition is still open")
        others = sorted((p for p in self.peers if p != self.node), key=int)
        if not others:
            raise SecureError(f"node {self.node}: no other participant to exchange with")
        rng = np.random.default_rng(secrets.randbits(128))
        count = len(codec.units)
        n = int(rng.integers(min(min_layers, count), min(max_layers, count) + 1))
        self.repetition = repetition
        out: list[Sealed] = []
        seqs: dict[str, int] = {}
        self.sent, self.buffers = [], {}
        for index in rng.choice(count, size=n, replace=False):
            index = int(index)
            dst = others[int(rng.integers(len(others)))]
            seq = seqs.get(dst, 0)
            seqs[dst] = seq + 1
            out.append((dst, seq, self._seal(SEND, dst, seq, codec, index, self.model)))
            self.sent.append((dst, index))
            self.buffers[index] = []  # the layer left its own buffer
        self.phase = "sent"
        return out

    def receive_and_return(self, incoming: Sequence[Sealed], codec: LayerCodec) -> list[Sealed]:
        """Stages 2 and 3: buffer every received layer, then send each sender a random element of
        the buffer of the index it sent."""
        if self.phase != "sent":
            raise SecureError(f"node {self.node}: layers to return arrived before stage 1")
        requests: list[tuple[str, int]] = []
        for src, index, layer in self._open_all(incoming, SEND, codec):
            self._buffer(index, codec).append(layer)
            requests.append((src, index))
        rng = np.random.default_rng(secrets.randbits(128))
        out: list[Sealed] = []
        seqs: dict[str, int] = {}
        for src, index in requests:
            buffer = self._buffer(index, codec)
            layer = buffer.pop(int(rng.integers(len(buffer))))
            seq = seqs.get(src, 0)
            seqs[src] = seq + 1
            out.append((src, seq, self._seal(RETURN, src, seq, codec, index, layer)))
        self.phase = "returned"
        return out

    def _open_all(self, incoming: Sequence[Sealed], stage: int, codec: LayerCodec) -> list[tuple[str, int, dict[str, np.ndarray]]]:
        """Open the sealed layers of ``stage`` addressed to this node: (sender, index, layer) each;
        a (sender, sequence number) that repeats is refused."""
        seen: set[tuple[str, int]] = set()
        out = []
        for src, seq, ciphertext in incoming:
            if (src, seq) in seen:
                raise SecureError(f"node {self.node}: a second layer from node {src} with sequence {seq}")
            seen.add((src, seq))
            try:
                index, layer = codec.decode(open_sealed(self.key_with(src), self.envelope(stage, src, self.node, seq), ciphertext))
            except SecureError as err:  # name the sender: the relay drops it along with this node
                raise SecureError(f"node {self.node}: {BAD_LAYER_FROM}{src} (sequence {seq}) cannot be used: {err}") from err
            out.append((src, index, layer))
        return out

    def _buffer(self, index: int, codec: LayerCodec) -> list[dict[str, np.ndarray]]:
        if index not in self.buffers:  # untouched so far: the model's own layer
            self.buffers[index] = [{key: self.model[key] for key in codec.units[index]}]
        return self.buffers[index]

    def _seal(self, stage: int, dst: str, seq: int, codec: LayerCodec, index: int, layer: Mapping[str, np.ndarray]) -> bytes:
        ciphertext = seal(self.key_with(dst), self.envelope(stage, self.node, dst, seq), codec.encode(index, layer))
        self.bytes_sealed += len(ciphertext)
        self.padding_sealed += codec.padding_bytes(index)
        return ciphertext

    # ------------------------------------------------------------------ persistence
    def to_state(self) -> dict[str, Any]:
        """Plain data for ``Context.state``: metadata (JSON-able), the private key, and the
        arrays (model, snapshot, buffers) as one flat dict."""
        meta = {
            "run_id": self.run_id,
            "server_round": self.server_round,
            "node": self.node,
            "step": self.step,
            "exchange": self.exchange,
            "attempt": self.attempt,
            "repetition": self.repetition,
            "phase": self.phase,
            "peers": {peer: key.hex() for peer, key in self.peers.items()},
            "sent": self.sent,
            "buffers": {str(index): len(layers) for index, layers in self.buffers.items()},
            "has_snapshot": self.snapshot is not None,
            "metrics": self.metrics,
            "bytes_sealed": self.bytes_sealed,
            "padding_sealed": self.padding_sealed,
            "public": self.public.hex(),
            "model_keys": list(self.model),
        }
        arrays = {f"m|{key}": value for key, value in self.model.items()}
        if self.snapshot is not None:
            arrays.update({f"s|{key}": value for key, value in self.snapshot.items()})
        for index, layers in self.buffers.items():
            for position, layer in enumerate(layers):
                arrays.update({f"b|{index}|{position}|{key}": value for key, value in layer.items()})
        return {"meta": json.dumps(meta), "private": self.private, "arrays": arrays}

    @classmethod
    def from_state(cls, meta_json: str, private: bytes, arrays: Mapping[str, np.ndarray]) -> NodeExchange:
        meta = json.loads(meta_json)
        keys = meta["model_keys"]
        node = cls(
            run_id=meta["run_id"],
            server_round=meta["server_round"],
            node=meta["node"],
            private=private,
            public=bytes.fromhex(meta["public"]),
            model={key: arrays[f"m|{key}"] for key in keys},
            step=meta["step"],
            exchange=meta["exchange"],
            attempt=meta["attempt"],
            repetition=meta["repetition"],
            phase=meta["phase"],
            snapshot={key: arrays[f"s|{key}"] for key in keys} if meta["has_snapshot"] else None,
            peers={peer: bytes.fromhex(key) for peer, key in meta["peers"].items()},
            sent=[(dst, int(index)) for dst, index in meta["sent"]],
            metrics=meta["metrics"],
            bytes_sealed=meta["bytes_sealed"],
            padding_sealed=meta["padding_sealed"],
        )
        for index, count in meta["buffers"].items():
            layers = []
            for position in range(count):
                prefix = f"b|{index}|{position}|"
                layers.append({name[len(prefix):]: value for name, value in arrays.items() if name.startswith(prefix)})
            node.buffers[int(index)] = layers
        return node
