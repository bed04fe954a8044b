#!/usr/bin/env bash
# make test-deploy: build deploy/Dockerfile with podman and run the local overlay with `podman kube play`,
# until the openai client gets an answer through the gateway container (deploy/podman/play.py).
#
#   needs (as root): apt-get install -y podman buildah debootstrap runc        (Debian bookworm: podman 4.3)
#   env:  PDSERVE_PODMAN_WORK  work directory (default /var/tmp/pdserve-podman: base rootfs, store, pod files)
#         BASE_IMAGE           a python >= 3.11 image to build on (default: a debootstrap'd bookworm, imported
#                              once as localhost/pdserve-base:bookworm — no image registry is needed)
#         TORCH_INDEX_URL      where the CPU torch wheel comes from (default: PyPI plus /opt/wheels if present)
#         DEBIAN_MIRROR        for debootstrap (default: deploy/podman/debian_mirror.py reads apt's sources)
#         BUILD_TIMEOUT, READY_TIMEOUT, CHAT_TIMEOUT   bounds in seconds (default 1200, 180, 180)
#   deploy/podman/test-deploy.sh --debian-mirror   prints the mirror debootstrap would get and exits
#                                                  (APT_DIR: apt's directory, default /etc/apt)
#
# Every step is bounded. On success, failure, SIGINT or SIGTERM the step running is stopped, the pods are
# taken down (podman kube down) and no pdserve pod or build container is left; a failure ends with one line,
# `test-deploy: FAILED: <reason>`, and a non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

REASON= TRAPPED=
fail() {  # the one-line reason: printed by the EXIT trap, or here before the trap is set
  REASON=$*
  [ -n "$TRAPPED" ] || echo "test-deploy: FAILED: $REASON" >&2
  exit 1
}

MIRROR=
debian_mirror() {  # MIRROR=DEBIAN_MIRROR or the mirror in apt's sources; fails unless it is exactly one URL
  MIRROR=${DEBIAN_MIRROR:-$(python3 "$ROOT/deploy/podman/debian_mirror.py" "${APT_DIR:-/etc/apt}")} || true
  [[ $MIRROR =~ ^https?://[^[:space:]]+$ ]] || fail "the Debian mirror is not one URL: '${MIRROR//$'\n'/\\n}'"
}
if [ "${1:-}" = --debian-mirror ]; then
  debian_mirror
  printf '%s\n' "$MIRROR"
  exit 0
fi

PY=${PY:-$ROOT/.venv/bin/python}
WORK=${PDSERVE_PODMAN_WORK:-/var/tmp/pdserve-podman}
IMAGE=localhost/pdserve:dev
BASE_IMAGE=${BASE_IMAGE:-localhost/pdserve-base:bookworm}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$ROOT/deploy/podman/containers.conf}
PLAY=$WORK/podman.yaml  # written by play.py: the pods to take down
for tool in podman debootstrap runc python3; do
  command -v "$tool" >/dev/null || fail "$tool not found: apt-get install -y podman buildah debootstrap runc"
done
[ -x "$PY" ] || fail "$PY not found: run make venv first"
mkdir -p "$WORK"

STEP=start CHILD=
# a step runs in the background so that a signal reaches the trap at once, not when the step ends
run_step() {  # run_step NAME LOG CMD...: its output to LOG; the play step's to the terminal too
  STEP=$1
  local log=$2 rc=0 tee_pid=
  shift 2
  if [ "$STEP" = play ]; then
    rm -f "$WORK/out.fifo" && mkfifo "$WORK/out.fifo"
    tee "$log" < "$WORK/out.fifo" &
    tee_pid=$!
    "$@" > "$WORK/out.fifo" 2>&1 &
  else
    "$@" > "$log" 2>&1 &
  fi
  CHILD=$!
  wait "$CHILD" || rc=$?
  if [ -n "$tee_pid" ]; then wait "$tee_pid" || true; fi  # LOG complete before it is read
  return "$rc"
}

unmount_rootfs() {  # debootstrap mounts /proc, /sys (and maybe /dev) inside the rootfs: never rm -rf through them
  local m
  for m in $(awk -v r="$WORK/rootfs/" 'index($2, r) == 1 { print $2 }' /proc/mounts | sort -r); do
    umount -l "$m" || true
  done
  rm -rf --one-file-system "$WORK/rootfs"
}

leftovers() {  # pdserve pods and build containers still there
  podman pod ps -q --filter name=pdserve- 2>/dev/null || true
  podman ps -aq --external --filter ancestor="$BASE_IMAGE" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  trap - EXIT
  trap '' INT TERM  # the clean-up runs to its end
  if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then
    kill -TERM "$CHILD" 2>/dev/null || true
    wait "$CHILD" 2>/dev/null || true
  fi
  if [ -f "$PLAY" ]; then podman kube down "$PLAY" >/dev/null 2>&1 || true; fi
  rm -f "$WORK/out.fifo"
  [ -d "$WORK/rootfs" ] && unmount_rootfs
  local left
  left=$(leftovers)
  if [ -n "$left" ]; then  # a build cut short can leave its working container
    podman pod rm -f $left >/dev/null 2>&1 || true
    podman rm -f $left >/dev/null 2>&1 || true
    buildah rm $left >/dev/null 2>&1 || true
  fi
  left=$(leftovers)
  if [ -n "$left" ]; then
    [ "$rc" -ne 0 ] || { rc=1; REASON="containers left after clean-up: $(echo $left)"; }
  fi
  if [ "$rc" -ne 0 ]; then
    echo "test-deploy: FAILED: ${REASON:-step $STEP ended with exit $rc} ($(($(date +%s) - T0)) s; logs: $WORK)" >&2
  fi
  exit "$rc"
}
T0=$(date +%s) TRAPPED=1
trap cleanup EXIT
trap 'REASON="SIGTERM during step $STEP"; exit 143' TERM
trap 'REASON="SIGINT during step $STEP"; exit 130' INT

if [ "$BASE_IMAGE" = localhost/pdserve-base:bookworm ] && ! podman image exists "$BASE_IMAGE"; then
  STEP=mirror
  debian_mirror
  echo "test-deploy: base image: debootstrap bookworm from $MIRROR (log: $WORK/debootstrap.log)" >&2
  [ -d "$WORK/rootfs" ] && unmount_rootfs
  run_step debootstrap "$WORK/debootstrap.log" timeout 600 nice -n 10 debootstrap --variant=minbase \
      --include=python3,python3-venv,ca-certificates bookworm "$WORK/rootfs" "$MIRROR" \
    || { tail -20 "$WORK/debootstrap.log" >&2; fail "debootstrap from $MIRROR"; }
  STEP=import
  tar -C "$WORK/rootfs" -c . | podman import -q - "$BASE_IMAGE" >/dev/null || fail "podman import of the rootfs"
  unmount_rootfs
  echo "test-deploy: base image imported in $(($(date +%s) - T0)) s" >&2
fi

BUILD_ARGS=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
CA=/etc/ssl/certs/ca-certificates.crt
[ -f "$CA" ] && BUILD_ARGS+=(-v "$CA:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  BUILD_ARGS+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
elif ls /opt/wheels/torch-*+cpu-*.whl >/dev/null 2>&1; then  # the CPU wheel is here; download.pytorch.org may not be
  TORCH_VERSION=$(basename "$(ls /opt/wheels/torch-*+cpu-*.whl | sort | tail -n 1)" | cut -d- -f2)
  BUILD_ARGS+=(-v /opt/wheels:/opt/wheels:ro --build-arg PIP_FIND_LINKS=/opt/wheels
               --build-arg TORCH_INDEX_URL=https://pypi.org/simple --build-arg "TORCH_SPEC=torch==$TORCH_VERSION")
fi
T1=$(date +%s)
OLD_IMAGE=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
echo "test-deploy: building $IMAGE (log: $WORK/build.log)" >&2
run_step build "$WORK/build.log" timeout "${BUILD_TIMEOUT:-1200}" nice -n 10 \
    podman build --force-rm -f deploy/Dockerfile -t "$IMAGE" "${BUILD_ARGS[@]}" . \
  || { tail -30 "$WORK/build.log" >&2; fail "podman build of deploy/Dockerfile (log: $WORK/build.log)"; }
T2=$(date +%s)
echo "test-deploy: image built in $((T2 - T1)) s" >&2
if [ -n "$OLD_IMAGE" ] && [ "$OLD_IMAGE" != "$(podman image inspect --format '{{.Id}}' "$IMAGE")" ]; then
  podman rmi "$OLD_IMAGE" >/dev/null 2>&1 || true  # the previous build, untagged now (~1.3 GB of its own)
fi

run_step play "$WORK/play.log" env PATH="$(dirname "$PY"):$PATH" "$PY" deploy/podman/play.py --work "$WORK" \
    --image "$IMAGE" --timeout "${READY_TIMEOUT:-180}" --chat-timeout "${CHAT_TIMEOUT:-180}" \
  || fail "deploy/podman/play.py: $(awk '/FAILED: /{r = $0; sub(/.*FAILED: /, "", r)} {last = $0}
                                           END {print (r != "" ? r : last)}' "$WORK/play.log")"
STEP=done
echo "test-deploy: OK in $(($(date +%s) - T0)) s (image build $((T2 - T1)) s)" >&2
