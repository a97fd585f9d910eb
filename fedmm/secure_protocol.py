"""The wire names of FedMR's secure recombination: message actions, records and their keys.

The server's phases (:mod:`strategies.secure_recombination`) and the node's handlers
(:mod:`client_app.secure`, registered in :mod:`client_app.client_app`) both import them from here.
They live beside the secure code rather than in :mod:`fedmm.protocol`, which keeps the names every
method shares; and in a module of their own rather than in :mod:`fedmm.secure`, so that reading
a name costs no ``cryptography`` import (the ClientApp registers its handlers by these names;
a test or bench that only looks at the messages needs no cipher). Like :mod:`fedmm.protocol`,
this module imports nothing.

Messages of one exchange (docs/secure_recombination.md):
``train.secure_keys`` → ``secure_send`` / ``secure_return`` per repetition → ``secure_upload``;
each carries the ``secure`` ConfigRecord, the relayed ciphertexts travel in ``secure-in`` (to a
node) and ``secure-out`` (from a node).
"""

from __future__ import annotations

# ----------------------------------------------------------------------------- actions
#: Message actions (``train.<action>``, see :mod:`fedmm.secure`): key setup (with the dispatched
#: model), stage 1 (send), stages 2-3 (receive, return), upload.
SECURE_KEYS = "secure_keys"
SECURE_SEND = "secure_send"
SECURE_RETURN = "secure_return"
SECURE_UPLOAD = "secure_upload"

# ----------------------------------------------------------------------------- record names
#: ConfigRecord of every secure-recombination message and reply (its keys below).
SECURE = "secure"
#: ArrayRecord of ciphertexts (uint8 arrays named "0", "1", ...) delivered to a node.
SECURE_IN = "secure-in"
#: ArrayRecord of ciphertexts a node hands the server to relay (same naming).
SECURE_OUT = "secure-out"

# ----------------------------------------------------------------------------- ``secure`` keys
#: Server → node: the settings, the step, the keys of the participants.
SECURE_MODE = "mode"
SECURE_EXCHANGE = "exchange"
SECURE_ATTEMPT = "attempt"
SECURE_REP = "repetition"
SECURE_MIN_LAYERS = "min-layers"
SECURE_MAX_LAYERS = "max-layers"
SECURE_PAD = "pad"
SECURE_GRANULARITY = "granularity"
SECURE_TRAIN = "train"
SECURE_ROLLBACK = "rollback"
SECURE_PEERS = "peers"
SECURE_PUBLIC_KEYS = "public-keys"
#: The ciphertexts of ``secure-in`` (sender, sequence number) and of ``secure-out`` (receiver,
#: sequence number), aligned with the arrays' order.
SECURE_IN_SRC = "in-src"
SECURE_IN_SEQ = "in-seq"
SECURE_OUT_DST = "out-dst"
SECURE_OUT_SEQ = "out-seq"
#: Node → server, in a ``secure_keys`` reply: the node's ephemeral X25519 public key (32 bytes).
SECURE_PUBLIC_KEY = "public-key"

# ----------------------------------------------------------------------------- metrics
#: ``metrics`` of an upload: ciphertext bytes the node sealed this round, padding included.
SECURE_BYTES_SEALED = "secure-bytes-sealed"
