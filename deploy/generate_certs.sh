#!/usr/bin/env bash
# Generate the TLS material and SuperNode key pairs of a *test* Flower deployment.
#
#   deploy/generate_certs.sh [--out DIR] [--host NAME]... [--supernodes N] [--days DAYS]
#                            [--rsa-bits BITS]
#
# Writes, under DIR (default: ./deploy/certs):
#   ca.crt, ca.key            a self-signed certificate authority
#   server.pem, server.key    the SuperLink's certificate, signed by the CA, valid for
#                             localhost, 127.0.0.1, ::1, "superlink" (the compose service
#                             name) and every --host given (a DNS name or an IP address)
#   supernode-keys/supernode-<i>, supernode-keys/supernode-<i>.pub   (i = 1..N)
#                             one ECDSA P-384 key pair per SuperNode in OpenSSH format: the
#                             private key stays on the SuperNode's machine
#                             (flower-supernode --auth-supernode-private-key), the public key
#                             is registered with `flwr supernode register`.
#
# Self-signed certificates are for testing only; use certificates from your organisation's
# CA (or e.g. Let's Encrypt) in production. Existing files are never overwritten: delete DIR
# to start again.
set -euo pipefail

out="deploy/certs"
days=365
rsa_bits=4096
supernodes=2
hosts=()

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit "${1:-0}"
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --host) hosts+=("$2"); shift 2 ;;
        --supernodes) supernodes="$2"; shift 2 ;;
        --days) days="$2"; shift 2 ;;
        --rsa-bits) rsa_bits="$2"; shift 2 ;;
        -h|--help) usage 0 ;;
        *) echo "unknown argument: $1" >&2; usage 2 >&2 ;;
    esac
done

for n in "$supernodes" "$days" "$rsa_bits"; do
    [[ "$n" =~ ^[0-9]+$ ]] || { echo "--supernodes, --days and --rsa-bits need whole numbers, got '$n'" >&2; exit 2; }
done
(( days >= 1 )) || { echo "--days must be at least 1, got $days" >&2; exit 2; }
(( rsa_bits >= 2048 )) || { echo "--rsa-bits must be at least 2048 (smaller RSA keys are insecure), got $rsa_bits" >&2; exit 2; }
for tool in openssl ssh-keygen; do
    command -v "$tool" >/dev/null || { echo "$tool is required but not installed" >&2; exit 1; }
done

mkdir -p "$out/supernode-keys"
cd "$out"
umask 077  # private keys readable by their owner only
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp" server.csr' EXIT

# A self-contained OpenSSL config (no dependency on the system's openssl.cnf), with the
# extensions that strict X.509 verification (the default from Python 3.13 on) expects.
cat >"$tmp/openssl.cnf" <<CNF
[req]
distinguished_name = dn
prompt = no
[dn]
O = fedmm test deployment
CN = fedmm test CA
[ca_ext]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
CNF

# --- certificate authority -------------------------------------------------------------
if [[ ! -f ca.crt ]]; then
    openssl genrsa -out ca.key "$rsa_bits" 2>/dev/null
    openssl req -x509 -new -key ca.key -sha256 -days "$days" \
        -config "$tmp/openssl.cnf" -extensions ca_ext -out ca.crt
    echo "created $out/ca.crt"
fi

# --- SuperLink server certificate --------------------------------------------------------
if [[ ! -f server.pem ]]; then
    san="DNS:localhost,IP:127.0.0.1,IP:::1,DNS:superlink"
    for h in ${hosts[@]+"${hosts[@]}"}; do  # (an empty array under `set -u` in bash 3)
        if [[ "$h" =~ ^[0-9.]+$ || "$h" == *:* ]]; then
            san+=",IP:$h"
        else
            san+=",DNS:$h"
        fi
    done
    cn="${hosts[0]:-localhost}"
    cat >"$tmp/server.ext" <<EXT
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = $san
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
EXT
    openssl genrsa -out server.key "$rsa_bits" 2>/dev/null
    openssl req -new -key server.key -config "$tmp/openssl.cnf" \
        -subj "/O=fedmm test deployment/CN=$cn" -out server.csr
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
        -days "$days" -sha256 -extfile "$tmp/server.ext" -out server.pem 2>/dev/null
    echo "created $out/server.pem for $san"
fi

# --- SuperNode key pairs -----------------------------------------------------------------
for ((i = 1; i <= supernodes; i++)); do
    key="supernode-keys/supernode-$i"
    if [[ ! -f "$key" ]]; then
        ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedmm supernode-$i" -f "$key"
        echo "created $out/$key (+ .pub)"
    fi
done

# --- the SuperExec shared secret -------------------------------------------------------------
# The SuperLink's one port also serves the Runtime API that the ServerApp's SuperExec uses: the
# shared secret keeps anyone else who reaches the port (a SuperNode's machine) from acting as one.
if [[ ! -f superexec.secret ]]; then
    (umask 077 && openssl rand -hex 32 > superexec.secret)
    echo "created $out/superexec.secret"
fi

# Certificates and public keys are not secret.
chmod 644 ca.crt server.pem supernode-keys/*.pub 2>/dev/null || true
