#!/usr/bin/env bash
# Runs the service on the embedded default: writes the tiny seeded Qwen3 checkpoint, starts a
# worker and the scheduler as separate processes, answers one request, and stops both.
# MODEL_KIND=moe|fp8|moe-fp8 runs a tiny Qwen3-MoE, a block-FP8 checkpoint, or both, instead.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check -r requirements.txt
MODEL_KIND=${MODEL_KIND:-dense}
if [ "$MODEL_KIND" = dense ]; then DEFAULT_MODEL=models/tiny-qwen3; else DEFAULT_MODEL=models/tiny-qwen3-$MODEL_KIND; fi
MODEL=${MODEL:-$DEFAULT_MODEL}
[ -f "$MODEL/config.json" ] || python -m common.tiny_model --out "$MODEL" --kind "$MODEL_KIND"
WORKER_PORT=${WORKER_PORT:-50061}
PORT=${PORT:-50051}
mkdir -p out
python -m worker_svc --model "$MODEL" --host 127.0.0.1 --port "$WORKER_PORT" >out/worker.log 2>&1 &
WORKER=$!
python -m scheduler_svc --model "$MODEL" --workers "127.0.0.1:$WORKER_PORT" --host 127.0.0.1 --port "$PORT" >out/scheduler.log 2>&1 &
SCHEDULER=$!
trap 'kill $SCHEDULER $WORKER 2>/dev/null; wait 2>/dev/null' EXIT
python -m common.healthcheck "127.0.0.1:$PORT" --wait 120
python -m tools.generate --target "127.0.0.1:$PORT" "${PROMPT:-Once upon a time}" --max-tokens "${MAX_TOKENS:-32}"
