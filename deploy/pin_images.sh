#!/usr/bin/env bash
# Pin the Flower images this deployment runs to the digests their tags name today.
#
#   deploy/pin_images.sh [OUT]          # default OUT: deploy/images.env
#   docker compose --env-file deploy/images.env -f deploy/compose.yaml up --build -d
#
# Run it once where a registry is reachable (it asks the registry, it pulls nothing), review
# the file, commit it where you keep your deployment. The compose file and the Dockerfile read
# SUPERLINK_IMAGE, SUPERNODE_IMAGE and SUPEREXEC_IMAGE and fall back to the plain tags of
# FLWR_VERSION without it. Needs `docker buildx` (Docker 19.03+) or `crane`.
set -euo pipefail

out=${1:-"$(dirname "$0")/images.env"}
version=${FLWR_VERSION:-1.42.0}

digest_of() {
    local ref=$1 found
    if command -v docker >/dev/null 2>&1 && found=$(docker buildx imagetools inspect "$ref" --format '{{.Manifest.Digest}}' 2>/dev/null); then
        :
    elif command -v crane >/dev/null 2>&1 && found=$(crane digest "$ref" 2>/dev/null); then
        :
    else
        echo "pin_images: cannot resolve $ref (need registry access and docker buildx or crane)" >&2
        return 1
    fi
    found=$(printf '%s' "$found" | tr -d '[:space:]')
    if [[ ! $found =~ ^sha256:[0-9a-f]{64}$ ]]; then
        echo "pin_images: $ref resolved to '$found', not a sha256 digest" >&2
        return 1
    fi
    printf '%s' "$found"
}

lines=("# Written by deploy/pin_images.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ): Flower $version images by digest."
       "FLWR_VERSION=$version")
for name in superlink supernode superexec; do
    ref="flwr/$name:$version"
    digest=$(digest_of "$ref")  # a failure stops the script: no file is written
    lines+=("$(echo "$name" | tr '[:lower:]' '[:upper:]')_IMAGE=$ref@$digest")
done
printf '%s\n' "${lines[@]}" >"$out.tmp"
mv "$out.tmp" "$out"
echo "pin_images: wrote $out"
