#!/usr/bin/env bash
# Entry point of the service image: maps environment variables (set by compose.yaml) to the
# services' command-line flags, so one image serves every role:
#   init-model   write the embedded tiny checkpoint into $MODEL_DIR unless a model is there
#   worker       python -m worker_svc on :50061
#   scheduler    python -m scheduler_svc on :50051, workers from $WORKERS
#   gateway      python -m gateway (OpenAI-compatible HTTP) on :8000, to $SCHEDULER_TARGET
#   anything     run as given (e.g. python -m tools.loadtest ...)
# Arguments after the role are appended to its command line. Empty variables add no flag, so
# the services' own defaults apply.
set -euo pipefail

args=()
flag() {  # flag NAME VALUE: appends --NAME VALUE when VALUE is non-empty
    if [[ -n ${2:-} ]]; then args+=("--$1" "$2"); fi
}

role=${1:-scheduler}
shift || true
case $role in
init-model)
    if [[ -f $MODEL_DIR/config.json ]]; then
        echo "model present in $MODEL_DIR"
        exit 0
    fi
    # Written beside its destination and renamed into place, so a reader never sees half a
    # checkpoint and an interrupted write leaves nothing behind that looks like a model.
    tmp=$(mktemp -d "$(dirname "$MODEL_DIR")/.tiny-qwen3.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    python -m common.tiny_model --out "$tmp" --seed "${TINY_MODEL_SEED:-0}" "$@" >/dev/null
    chmod -R a+rX "$tmp"
    mv -T "$tmp" "$MODEL_DIR"
    echo "wrote the tiny Qwen3 checkpoint to $MODEL_DIR"
    ;;
worker)
    flag device "${DEVICE:-}"
    flag dtype "${DTYPE:-}"
    flag block-size "${BLOCK_SIZE:-}"
    flag num-kv-blocks "${NUM_KV_BLOCKS:-}"
    flag kv-cache-memory-gb "${KV_CACHE_MEMORY_GB:-}"
    flag gpu-memory-utilization "${GPU_MEMORY_UTILIZATION:-}"
    flag max-model-len "${MAX_MODEL_LEN:-}"
    flag max-num-seqs "${MAX_NUM_SEQS:-}"
    flag max-num-batched-tokens "${MAX_NUM_BATCHED_TOKENS:-}"
    flag attention-backend "${ATTENTION_BACKEND:-}"
    flag kv-cache-dtype "${KV_CACHE_DTYPE:-}"
    flag lm-head-dtype "${LM_HEAD_DTYPE:-}"
    flag kernel-cache-dir "${KERNEL_CACHE_DIR:-}"
    flag seed "${SEED:-}"
    flag speculative-method "${SPECULATIVE_METHOD:-}"
    flag num-speculative-tokens "${NUM_SPECULATIVE_TOKENS:-}"
    flag speculative-model "${SPECULATIVE_MODEL:-}"
    exec python -m worker_svc --model "$MODEL_DIR" --host 0.0.0.0 --port 50061 "${args[@]}" "$@"
    ;;
scheduler)
    flag max-model-len "${MAX_MODEL_LEN:-}"
    flag max-num-seqs "${MAX_NUM_SEQS:-}"
    flag max-num-batched-tokens "${MAX_NUM_BATCHED_TOKENS:-}"
    flag speculative-max-batch-size "${SPECULATIVE_MAX_BATCH_SIZE:-}"
    exec python -m scheduler_svc --model "$MODEL_DIR" --host 0.0.0.0 --port 50051 \
        --workers "${WORKERS:-dns:///worker:50061}" "${args[@]}" "$@"
    ;;
gateway)
    # API keys: QWEN3_SERVE_GATEWAY_API_KEY (comma-separated) or a file of them, one a line.
    flag api-key-file "${GATEWAY_API_KEY_FILE:-}"
    exec python -m gateway --host 0.0.0.0 --port 8000 \
        --target "${SCHEDULER_TARGET:-scheduler:50051}" "${args[@]}" "$@"
    ;;
*)
    exec "$role" "$@"
    ;;
esac
