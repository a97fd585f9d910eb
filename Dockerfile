# fedmm SuperExec image: runs this app's ServerApp (next to a SuperLink) and ClientApps (next
# to each SuperNode) with the Flower Deployment Runtime, in `--isolation process` mode.
#
#   docker build -t fedmm-superexec:0.1.0 .
#
# Built on Flower's official SuperExec image of the pinned Flower version, which already holds
# `flwr` (the image runs as the non-root user `app`, uid 49999, HOME=/app). Only the app's other
# dependencies are installed here: the app's code is not baked in, `flwr run` ships it to the
# SuperLink and SuperNodes as a FAB for every run. See docs/deployment.md.
# SUPEREXEC_IMAGE: the base by tag, or by digest (deploy/pin_images.sh writes
# flwr/superexec:<version>@sha256:... into deploy/images.env; compose passes it here).
ARG SUPEREXEC_IMAGE=flwr/superexec:1.42.0
FROM ${SUPEREXEC_IMAGE}

WORKDIR /app

# Dependencies only (see .dockerignore: pyproject.toml is the whole build context). As in the
# Flower Docker docs, drop pyproject's `flwr[...]` requirement: the base image provides flwr (the
# Deployment Runtime needs no Ray, and a second flwr requirement could move the image's own), and
# add the `[dp]` extra (the privacy accountant's dp-accounting) at the image's own flwr version.
# constraints.txt: the versions behind the published numbers, less its flwr pin (the image's
# FLWR_VERSION decides, e.g. 1.43.0 with FLWR_VERSION=1.43.0).
COPY --chown=app:app pyproject.toml constraints.txt ./
RUN sed -i '/^ *"flwr\[/d' pyproject.toml \
    && grep -v '^flwr==' constraints.txt > constraints-image.txt \
    && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
    && echo "flwr[dp]==$(python -c 'import flwr; print(flwr.__version__)')" >> requirements.txt \
    && python -m pip install -U --no-cache-dir -c constraints-image.txt -r requirements.txt

# The run results of a ServerApp (results_root in conf/config.yaml) land here: mount a volume.
RUN mkdir -p /app/fedmm-results

ENTRYPOINT ["flower-superexec"]
