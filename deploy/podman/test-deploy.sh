#!/usr/bin/env bash
# make test-deploy: build deploy/Dockerfile with podman and run the local overlay with `podman kube play`,
# until the openai client gets an answer through the gateway container (deploy/podman/play.py).
#
#   needs (as root): apt-get install -y podman buildah debootstrap runc        (Debian bookworm: podman 4.3)
#   env:  PDSERVE_PODMAN_WORK  work directory (default /var/tmp/pdserve-podman: base rootfs, store, pod files)
#         BASE_IMAGE           a python >= 3.11 image to build on (default: a debootstrap'd bookworm, imported
#                              once as localhost/pdserve-base:bookworm — no image registry is needed)
#         TORCH_INDEX_URL      where the CPU torch wheel comes from (default: PyPI plus /opt/wheels if present)
#         DEBIAN_MIRROR        for debootstrap (default: the first deb.debian.org-like URI in apt's sources)
# Cleans up on success and failure: podman kube down (pods and their containers removed).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
WORK=${PDSERVE_PODMAN_WORK:-/var/tmp/pdserve-podman}
IMAGE=localhost/pdserve:dev
export CONTAINERS_CONF=${CONTAINERS_CONF:-$ROOT/deploy/podman/containers.conf}
mkdir -p "$WORK"

for tool in podman debootstrap runc; do
  command -v "$tool" >/dev/null || { echo "test-deploy: $tool not found: apt-get install -y podman buildah debootstrap runc" >&2; exit 2; }
done
[ -x "$PY" ] || { echo "test-deploy: $PY not found: run make venv first" >&2; exit 2; }
T0=$(date +%s)

BASE_IMAGE=${BASE_IMAGE:-localhost/pdserve-base:bookworm}
if [ "$BASE_IMAGE" = localhost/pdserve-base:bookworm ] && ! podman image exists "$BASE_IMAGE"; then
  MIRROR=${DEBIAN_MIRROR:-$(grep -rhoE '^(URIs:|deb) *https?://[^ ]+/debian/?' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
                             | head -1 | grep -oE 'https?://[^ ]+' || echo http://deb.debian.org/debian)}
  echo "test-deploy: base image: debootstrap bookworm from $MIRROR" >&2
  rm -rf "$WORK/rootfs"
  nice -n 10 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$WORK/rootfs" "$MIRROR" \
    > "$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  tar -C "$WORK/rootfs" -c . | podman import - "$BASE_IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
fi

BUILD_ARGS=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
CA=/etc/ssl/certs/ca-certificates.crt
[ -f "$CA" ] && BUILD_ARGS+=(-v "$CA:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  BUILD_ARGS+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
elif ls /opt/wheels/torch-*+cpu-*.whl >/dev/null 2>&1; then  # the CPU wheel is here; download.pytorch.org may not be
  TORCH_VERSION=$(basename /opt/wheels/torch-*+cpu-*.whl | cut -d- -f2 | head -1)
  BUILD_ARGS+=(-v /opt/wheels:/opt/wheels:ro --build-arg PIP_FIND_LINKS=/opt/wheels
               --build-arg TORCH_INDEX_URL=https://pypi.org/simple --build-arg "TORCH_SPEC=torch==$TORCH_VERSION")
fi
echo "test-deploy: building $IMAGE (log: $WORK/build.log)" >&2
nice -n 10 podman build -f deploy/Dockerfile -t "$IMAGE" "${BUILD_ARGS[@]}" . > "$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log" >&2; echo "test-deploy: image build failed" >&2; exit 1; }
T1=$(date +%s)
echo "test-deploy: image built in $((T1 - T0)) s" >&2

PATH=$(dirname "$PY"):$PATH "$PY" deploy/podman/play.py --work "$WORK" --image "$IMAGE"
echo "test-deploy: total $(($(date +%s) - T0)) s (build $((T1 - T0)) s)" >&2
