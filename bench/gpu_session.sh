#!/usr/bin/env bash
# One GPU session's calls, so each device command is short: `bash bench/gpu_session.sh CALL`.
# Runs on the GPU machine (its python3 holds a CUDA torch); packages it lacks travel as wheels under
# .whl/ (bench/README-style notes in docs/PERF_NOTES.md). Results: JSON and logs under $OUT.
#   base      install the pinned gRPC/protobuf wheels (.whl/base) into /tmp/base
#   tests     GPU tests (kernels, attention backends, CUDA graphs and the mixed steps' graphs, the pipelined runner, MoE/FP8)
#   smoke     a short gpu_bench run that exercises the service end to end
#   fa4       install FlashAttention-4 (.whl/fa4a + .whl/fa4b) and run its tests and the attention bench
#   bench     the gpu_bench stages given in STAGES (default: service,offline), results under NAME (full)
#   budget    the service at each step token budget of BUDGET_ORDER (default "32768 16384": the bench's
#             --max-num-batched-tokens, for the worker and the scheduler) in turn: tok/s, TTFT and the mixed steps' step against device time (v51)
#   onerow    a one-row decode's worker, steps ONEROW_STEPS (default 40-46) traced with every thread's Python
#             (tools.trace_gaps; v53)
#   blocking  decode (CASES, default 1/4/16/64 x 1024) with each step's done event spinning and sleeping in its wait
#             (WORKER_BLOCKING_SYNC 0 and 1, BLOCK_ORDER "0 1 0 1"), one machine; BLOCK_SERVICE=1 adds the service (v53)
#   stream    decode (CASES, default 1/4/16/64 x 1024) with steps as calls and over the Steps stream (QWEN3_SERVE_NO_STEP_STREAM
#             1 and 0, STREAM_ORDER "1 0 1 0"), one machine; STREAM_SERVICE=1 adds the service (v54)
#   spy       the decode stage's processes at CASES (default 1x1024) under py-spy (.whl/spy): which Python holds the
#             interpreter lock, by process and function (tools.spy_table; v53)
#   mixed     the mixed steps' CUDA graphs (WORKER_MIXED_GRAPHS, on by default since v53): their GPU tests, then the service
#             with them on and off in turn (MIXED_ORDER, default "1 0"), one machine: tok/s, TTFT, the mixed steps' step and device time
#   kv        the service with a bf16 and an FP8 KV cache, side by side
#   single    one stream through the service with the fourth step in flight off and on in turn (v48)
#   hostprof  the service with its first eager steps' launches under torch.profiler: host time by op (v50)
#   trace     the service with steps TRACE_STEPS (default 8-26: its mixed steps) in one torch.profiler trace, read by
#             tools.trace_gaps (the device's idle gaps, what the host did in each); TRACE_STACK_STEPS (default 14-16)
#             again with every thread's Python calls (v51)
#   spec      the speculative-decoding stage (bench/stages/spec.py) with the flags in EXTRA
#   spec-service  the same through the real processes (bench/stages/spec_service.py), flags in EXTRA
#   moe       the MoE/FP8 stages given in STAGES (their options in EXTRA)
#   fp8       Qwen3-8B decode, FP8 weights against bf16 (in-process): at 1 row (and the start-up choice
#             there per FP8 kind), 16 rows, and 256 rows with the quantization fused into RMSNorm/SwiGLU and
#             without (WORKER_FP8_QUANT_FUSION=0): issue 24's 1.7x and 1.3x; tables and logs under $OUT/<run>.
#             A cold machine's first start-up compiles ~2.5 min for each dtype (v42): run fp8few first there,
#             whose compiled kernels this call then finds
#   fp8few    Qwen3-8B decode at 1 row (16 too with FP8FEW_B16=1), bf16 and FP8, with what the selection chose at
#             1-32 rows, then the FP8 GEMM's few-row GPU tests (the tiles for wgmma, PERF_NOTES v41)
#   b1ab      Qwen3-8B decode at 1 row, bf16 and FP8, on .gpu/ref (scripts/gpu_ref.sh REF) and on this tree
#   moe8      Qwen3-30B-A3B bf16 and FP8 on bench.py's workload; FP8 with the experts' modes by the old rule too,
#             and with the weight-only experts converting their weights (WORKER_MOE_FP8_BITS=0)
#   prof8     Qwen3-8B decode-graph kernels a step, FP8 (1/16/256 rows) and bf16 (1/256), context 128
#   prof06    Qwen3-0.6B decode-graph kernels a step at 1/16/256 rows, context 1024 (issue 23's table)
#   depth     Qwen3-0.6B pipelined decode at 1/4/16/64/256 x 1024 with two and three steps in flight (the
#             scheduler's third step at small batches, PERF_NOTES v39), the service's headline beside it
#   ab06      Qwen3-0.6B pipelined decode at CASES (default 1/4/16 x 1024; each tree's default steps in flight; compare
#             the device column) on .gpu/ref and on this tree in the order AB_ORDER (default "ref tree"), one
#             machine (scripts/gpu_ref.sh REF first; carry .gpu): e.g. REF 62abf9d, before the folded norm and
#             the late trigger (PERF_NOTES v40: two H200s disagreed on the one-row device step)
#   longest   attention with its programs longest context first (PERF_NOTES v40): the splits stage's 256-request
#             cases (ordered beside the default), then the service and large-batch decode with
#             WORKER_ATTENTION_LONGEST_FIRST=64 and without, in one call (the step log's large-batch rows)
#   ashort    attention at short contexts and large batches (64/256 x 128), every launch config at 1 and 2 splits,
#             with Qwen3-8B's heads and then Qwen3-0.6B's (PERF_NOTES v42: 8B's attention at 67% of the copy rate there)
#   fp8head   Qwen3-8B FP8 decode with the LM head in FP8 (--lm-head-dtype fp8) at 1, 16 and 256 rows (HEAD_ROWS),
#             beside an `fp8` or fp8few call's bf16 and FP8 runs on the same machine (PERF_NOTES v43)
#   hfirst    the 256-request decode launches with their grids' kv heads first (LaunchConfig.heads_first) and
#             not: over an FP8 cache (Qwen3-0.6B's heads, 1 and 2 splits), then over a bf16 cache with
#             Qwen3-0.6B's and Qwen3-8B's heads (PERF_NOTES v44)
#   ragged    bf16 decode of ragged contexts (100-2048) at 16, 64 and 256 requests, every launch longest first
#             and kv heads first: the tile kernel's configs at 1/2/4 splits (whether the 256-request table and
#             WORKER_ATTENTION_LONGEST_FIRST's 64 still hold now that longest first orders the whole launch)
#   hfservice the service (STAGES, default bandwidth,service) with WORKER_ATTENTION_HEADS_FIRST=0 and 1 (v44)
#   pdlchain  the decode layer's kernels as one PDL chain (WORKER_PDL_CHAIN, PERF_NOTES v45) off and on, one machine:
#             Qwen3-0.6B pipelined decode at CASES (default 1/4/16/64/256 x 1024), then (PDL8=1) Qwen3-8B FP8 at one row
#   wholeslice  GEMVs that read their whole weight slice before the PDL wait (WORKER_GEMV_WHOLE_SLICE_ROWS, v46) at each
#             row bound of WS_ORDER in turn (0 = off), one machine: Qwen3-0.6B decode at CASES (default 1/2/4/16 x 1024);
#             WS_PROF=1 adds prof06 with them at one row
#   decodeqk  pure-decode attention taking the raw qkv projection off and up to 64 rows in turn (WORKER_ATTENTION_DECODE_QK_ROWS, v48, v50)
#   ws8       Qwen3-8B FP8 at one row with whole-slice GEMVs allowed for FP8 weights up to WS8_MIB's bounds (v47)
#   pdlservice  the service (STAGES, default bandwidth,service) with WORKER_PDL_CHAIN=0 and 1 (v45), one machine
#   aconf     the bf16 decode attention's tile (AC_TILES) and programs per SM (AC_WPS) in the decode chain (v56)
#   smallgemm cuBLAS against a plain Triton GEMM on the projections at 64-512 rows (v56)
#   ncu       a decode step's kernels under Nsight Compute (bench/probes/ncu_decode.py): Qwen3-0.6B at NCU_BATCHES
#             (default 1 16 64) x 1024, NCU8=1 adds Qwen3-8B FP8 at NCU8_BATCHES (default 1); per-kernel tables (v56)
#   stage     one stage module alone (STAGE, e.g. sampler) with the flags in EXTRA, results under NAME
#   ab        one stage module (STAGE) on .gpu/ref and on this tree, flags in EXTRA, each one's table in
#             turn (the json of each under $OUT/ref and $OUT/tree)
#   spec-ab   the spec stage (or SPEC_STAGE=spec_service) on .gpu/ref (another tree: scripts/gpu_ref.sh
#             REF writes it) and on this tree, with the flags in EXTRA (the reference's in REF_EXTRA when
#             given, e.g. fewer methods), then both side by side (carry .gpu with .whl)
set -uo pipefail
PY=${PY:-$(command -v python3)}
[[ -x /opt/torch/.venv/bin/python3 ]] && PY=/opt/torch/.venv/bin/python3
OUT=${OUT:-/tmp/out}
BENCH=${BENCH:-/tmp/bench}
mkdir -p "$OUT" "$BENCH"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 PY
export PYTHONPATH=/tmp/base${PYTHONPATH:+:$PYTHONPATH}
[[ -f /tmp/site/fa4_env.sh ]] && source /tmp/site/fa4_env.sh

base() {
    if [[ ! -d /tmp/base/grpc ]]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/base .whl/base/*.whl || exit 1
        [[ -d .whl/xg ]] && $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/base .whl/xg/*.whl
        # xgrammar's runtime (apache-tvm-ffi), for the structured stage
        [[ -d .whl/tvm ]] && $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/base .whl/tvm/*.whl
    fi
    $PY -c "import grpc, google.protobuf, torch; print('grpc', grpc.__version__, 'protobuf', google.protobuf.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
}

copy_logs() {   # the JSON results, and the logs as one archive, under $OUT (8 files come back at most)
    tar czf "$OUT/$1-results.tgz" -C "$BENCH/$1" --exclude model . 2>/dev/null
    true
}

one_row_choices() {   # DIR: what the start-up selection chose at 1 row for each FP8 kind, from the logs under DIR
    grep -rhao "linear [a-z_]* [0-9x]* fp8 .*ms per call by rows: 1: [^;]*" "$1" 2>/dev/null \
        | sed "s/ms per call by rows: //" | head -4
}

profile_table() {   # NAME TIMEOUT EXTRA: the profile stage's tables (top kernels, serial wall time a step)
    STAGE=profile NAME=$1 TIMEOUT=$2 LINES_OUT=130 EXTRA="$3" bash "$0" stage 2>&1 | grep "profile (\|  .*%  \|device busy" | head -${PROFILE_LINES:-90}
}

decode_ab() {   # VAR TAG "VALUES" CASES [HOOK]: Qwen3-0.6B pipelined decode at CASES with the environment's VAR at each
                # of VALUES in turn, one machine; HOOK (a function) gets each run's directory before it is removed
    local var=$1 tag=$2 values=$3 cases=$4 hook=${5:-}
    for n in $values; do
        mkdir -p "/tmp/$tag-$n" && cp "$BENCH/bandwidth.json" "/tmp/$tag-$n/" 2>/dev/null
        env "$var=$n" timeout ${TIMEOUT:-200} $PY -m bench.gpu_bench --out "/tmp/$tag-$n" --model "$BENCH/model" \
            --stages decode --decode-cases "$cases" --decode-measured-steps 60 2>&1 \
            | grep -v "^ *$" | tail -${LINES_OUT:-6} | sed "s/^/$var=$n: /"
        [[ -n $hook ]] && $hook "/tmp/$tag-$n" | sed "s/^/$var=$n: /"
        cp "/tmp/$tag-$n/decode.json" "$OUT/decode-$tag${n//[^A-Za-z0-9._-]/_}-$(date +%s).json" 2>/dev/null
        rm -rf "/tmp/$tag-$n"
    done
}

one_row_linear() {   # DIR: the one-row choice of each linear kind in a run's logs
    grep -rhao "linear [a-z_]* .*ms per call by rows: 1: [^;]*" "$1" | head -6
}

few_row_linear() {   # DIR: each linear kind's choice at 16, 32 and 64 rows in a run's logs
    grep -rhao "linear [a-z_]* .*ms per call by rows: .*" "$1" | head -6 \
        | sed -E 's/^linear ([a-z_]*) .*by rows: /\1 /; s/; (1|2|4|8): [^;]*//g; s/^([a-z_]*) 1: [^;]*;/\1/'
}

service_steps() {  # DIR GLOB LABEL: each service run's tok/s, TTFT and its mixed steps' step against device time
    $PY - "$1" "$2" "$3" <<'PY'
import json, pathlib, sys
print(f"{sys.argv[3]:>12}   tok/s  TTFT p50 ms  mixed steps  mixed step ms  mixed device ms  all step ms  all device ms")
for path in sorted(pathlib.Path(sys.argv[1]).glob(sys.argv[2])):
    try:
        r = json.loads(path.read_text())["result"]
    except (OSError, KeyError, ValueError) as exc:
        print(path.name, "no result", repr(exc))
        continue
    steps = r.get("steps") or {}
    mixed = [v for k, v in steps.get("kinds", {}).items() if k.startswith("mixed")]
    print(f"{path.stem.split('-', 2)[-1]:>12} {r['output_tokens'] / r['seconds']:7.0f} {r['ttft_median_s'] * 1e3:12.0f}"
          f" {sum(v['steps'] for v in mixed):12d} {sum(v['step_ms'] for v in mixed):14.1f}"
          f" {sum(v['device_ms'] for v in mixed):16.1f} {steps.get('step_ms', 0):12.1f} {steps.get('device_ms', 0):14.1f}")
PY
}

with_floor() {  # the bandwidth measured by `checkpoint`, for the floor in the tables
    mkdir -p "$BENCH/$1" && cp "$BENCH/bandwidth.json" "$BENCH/$1/" 2>/dev/null
    true
}

case ${1:-} in
    base) base ;;
    tests)
        base
        # -o addopts=: the GPU image's python may lack the plugins pyproject.toml names (xdist, timeout)
        timeout ${TIMEOUT:-300} $PY -m pytest -q --tb=line -rfs -p no:cacheprovider -o addopts= ${TESTS:-tests/unit/test_gpu_pipelined_runner.py tests/unit/test_mixed_graphs.py \
            tests/unit/test_drafting_graphs.py tests/unit/test_fused_kernels.py tests/unit/test_decode_qk.py tests/unit/test_cuda_graphs.py tests/unit/test_attention_backends.py \
            tests/unit/test_moe_kernels.py tests/unit/test_fp8_kernels.py} 2>&1 | tail -${LINES_OUT:-40}
        ;;
    smoke)
        base
        with_floor smoke
        timeout ${TIMEOUT:-420} $PY -m bench.gpu_bench --out "$BENCH/smoke" --model "$BENCH/model" \
            --stages ${STAGES:-service,decode} --num-requests ${NUM:-64} --stream-intervals 1 \
            --decode-cases ${CASES:-1x1024,256x1024} ${EXTRA:-} 2>&1 | tail -45
        copy_logs smoke
        ;;
    checkpoint)
        base
        timeout ${TIMEOUT:-300} $PY -m bench.gpu_bench --out "$BENCH" --stages checkpoint,bandwidth 2>&1 | tail -5
        cp "$BENCH"/bandwidth.json "$OUT/" 2>/dev/null; true
        ;;
    fa4)
        base
        mkdir -p /tmp/fa4whl && cp .whl/fa4*/* /tmp/fa4whl/ 2>/dev/null
        if [[ ! -f /tmp/site/fa4_env.sh ]]; then
            bash scripts/fa4_install.sh --python "$PY" /tmp/fa4whl || exit 1
            source /tmp/site/fa4_env.sh
        fi
        timeout ${TIMEOUT:-330} $PY -m pytest -q --tb=short -rfs -p no:cacheprovider -o addopts= \
            tests/unit/test_attention_backends.py \
            tests/unit/test_cuda_graphs.py tests/e2e/test_attention_selection.py 2>&1 | tail -25
        timeout 240 $PY -m bench.attention_backends_bench --out "$OUT/attention.json" 2>&1 | grep -v '^{' | tail -60
        ;;
    stash)   # the FA4 wheels of one call, kept on the machine for the next
        mkdir -p /tmp/fa4whl && cp .whl/fa4*/* /tmp/fa4whl/ && ls /tmp/fa4whl | wc -l
        ;;
    bench)
        base
        # The stages read the checkpoint under $BENCH/model: written once per machine, by `checkpoint`.
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        NAME=${NAME:-full}
        with_floor "$NAME"
        timeout ${TIMEOUT:-560} $PY -m bench.gpu_bench --out "$BENCH/$NAME" --model "$BENCH/model" \
            --stages ${STAGES:-service,offline} ${EXTRA:-} 2>&1 | tail -${LINES_OUT:-60}
        copy_logs "$NAME"
        ;;
    single) # one stream (and then SINGLE_STREAMS streams) through the service, the fourth step in flight off and
            # on in turn (QWEN3_SERVE_FOURTH_STEP_MAX_SEQS=0 / 4, PERF_NOTES v47-v48), SINGLE_ORDER (default "0 4 0 4")
        base
        i=0
        for fourth in ${SINGLE_ORDER:-0 4 0 4}; do
            i=$((i + 1))
            for streams in 1 ${SINGLE_STREAMS:-}; do
                QWEN3_SERVE_FOURTH_STEP_MAX_SEQS=$fourth NAME=single-$i-$fourth-$streams STAGES=service \
                    EXTRA="--stream-intervals 1 --num-requests $streams --min-len 1000 --max-len 1024 --client-processes 1" \
                    TIMEOUT=${TIMEOUT:-200} LINES_OUT=2 bash "$0" bench
            done
        done
        $PY - "$BENCH" <<'PY'
import json, pathlib, sys
print("run                 tok/s  TTFT p50 ms  TPOT p50 ms")
for path in sorted(pathlib.Path(sys.argv[1]).glob("single-*/service.json")):
    r = json.loads(path.read_text())["result"]
    print(f"{path.parent.name:18} {r['output_tokens'] / r['seconds']:6.0f} {r['ttft_median_s'] * 1e3:12.1f}"
          f" {(r['tpot_median_s'] or 0) * 1e3:12.2f}")
PY
        ;;
    hostprof)   # the service (default flags, interval 1) with its first HOSTPROF_STEPS (default 14) eager steps'
                # launches under torch.profiler (WORKER_PROFILE_EAGER_STEPS, PERF_NOTES v50: mixed steps took as long
                # to launch as to run): each one's host time by op, from the worker's log, under $OUT/hostprof.txt
        base
        WORKER_PROFILE_EAGER_STEPS=${HOSTPROF_STEPS:-14} STAGES=bandwidth,service NAME=hostprof \
            EXTRA="--stream-intervals 1" TIMEOUT=${TIMEOUT:-300} LINES_OUT=4 bash "$0" bench
        grep -ah -A$((25 + 8)) "eager step" "$BENCH"/hostprof/logs/worker-*.log > "$OUT/hostprof.txt"
        grep -ah "eager step" "$BENCH"/hostprof/logs/worker-*.log | cut -c1-160
        head -${LINES_OUT:-80} "$OUT/hostprof.txt"
        ;;
    trace)  # one torch.profiler trace over the service's steps TRACE_STEPS, then TRACE_STACK_STEPS with Python stacks
        base
        for mode in plain stack; do
            steps=${TRACE_STEPS:-8-26}; stack=0
            [[ $mode == stack ]] && { steps=${TRACE_STACK_STEPS:-14-16}; stack=1; }
            [[ -z $steps || $steps == none ]] && continue
            mkdir -p "$OUT/trace-$mode"
            WORKER_PROFILE_TRACE_STEPS=$steps WORKER_PROFILE_TRACE_STACK=$stack WORKER_PROFILE_TRACE_DIR="$OUT/trace-$mode" \
                STAGES=${STAGES:-bandwidth,service} NAME=trace-$mode EXTRA="--stream-intervals 1" TIMEOUT=${TIMEOUT:-240} \
                LINES_OUT=3 bash "$0" bench
            for t in "$OUT/trace-$mode"/worker-trace-*.json; do
                [[ -f $t ]] || { echo "$mode: no trace written"; continue; }
                echo "== $mode $(basename "$t")"
                $PY -m tools.trace_gaps "$t" --top ${TRACE_TOP:-12} | tee "$t.gaps.txt" | head -${TRACE_LINES:-70}
                gzip -f "$t"
            done
        done
        ;;
    budget) # the service at each step token budget in BUDGET_ORDER: fewer, larger mixed steps pay the eager launch fewer times
        base
        for b in ${BUDGET_ORDER:-32768 16384}; do
            NAME=budget-$b STAGES=${STAGES:-service} EXTRA="--stream-intervals 1 --max-num-batched-tokens $b" \
                TIMEOUT=${TIMEOUT:-200} LINES_OUT=2 bash "$0" bench
            cp "$BENCH/budget-$b/service.json" "$OUT/service-budget-$b.json" 2>/dev/null
        done
        service_steps "$OUT" "service-budget-*.json" budget
        ;;
    onerow) # a one-row decode's worker (1 x 1024), steps ONEROW_STEPS (default 40-46) in one torch.profiler trace with every
            # thread's Python, read by tools.trace_gaps: where the worker's host time goes at one row (v52-v53)
        base
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        mkdir -p /tmp/onerow "$OUT/onerow" && cp "$BENCH/bandwidth.json" /tmp/onerow/ 2>/dev/null
        WORKER_PROFILE_TRACE_STEPS=${ONEROW_STEPS:-40-46} WORKER_PROFILE_TRACE_STACK=1 WORKER_PROFILE_TRACE_DIR="$OUT/onerow" \
            timeout ${TIMEOUT:-200} $PY -m bench.gpu_bench --out /tmp/onerow --model "$BENCH/model" --stages decode \
            --decode-cases 1x1024 2>&1 | grep -E "^ +[0-9]+ +[0-9]+ +[0-9]" | sed "s/^/traced: /"
        for t in "$OUT/onerow"/worker-trace-*.json; do
            [[ -f $t ]] || { echo "no trace written"; continue; }
            $PY -m tools.trace_gaps "$t" --top ${TRACE_TOP:-12} | tee "$t.gaps.txt" | head -${TRACE_LINES:-60}
            gzip -f "$t"
        done
        ;;
    blocking) # each step's done event spinning (0: CUDA's default) or sleeping (1) in its reply's wait (WORKER_BLOCKING_SYNC,
              # v53) in turn on one machine: decode at CASES (default 1/4/16/64 x 1024), then (BLOCK_SERVICE=1) the service
        base
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        decode_ab WORKER_BLOCKING_SYNC block "${BLOCK_ORDER:-0 1 0 1}" "${CASES:-1x1024,4x1024,16x1024,64x1024}"
        if [[ -n ${BLOCK_SERVICE:-} ]]; then
            for b in 1 0; do
                WORKER_BLOCKING_SYNC=$b NAME=block-$b STAGES=service EXTRA="--stream-intervals 1" TIMEOUT=200 LINES_OUT=2 \
                    bash "$0" bench
                cp "$BENCH/block-$b/service.json" "$OUT/service-block-$b.json" 2>/dev/null
            done
            service_steps "$OUT" "service-block-*.json" blocking
        fi
        ;;
    stream) # the steps as Step calls (1) and over the Steps stream (0, the default since v54) in turn on one machine: decode at
            # CASES (default 1/4/16/64 x 1024), then (STREAM_SERVICE=1) the service
        base
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        decode_ab QWEN3_SERVE_NO_STEP_STREAM stream "${STREAM_ORDER:-1 0 1 0}" "${CASES:-1x1024,4x1024,16x1024,64x1024}"
        if [[ -n ${STREAM_SERVICE:-} ]]; then
            for c in 1 0; do
                QWEN3_SERVE_NO_STEP_STREAM=$c NAME=calls-$c STAGES=service EXTRA="--stream-intervals 1" TIMEOUT=200 \
                    LINES_OUT=2 bash "$0" bench
                cp "$BENCH/calls-$c/service.json" "$OUT/service-calls-$c.json" 2>/dev/null
            done
            service_steps "$OUT" "service-calls-*.json" stream
        fi
        ;;
    spy)    # the decode stage's processes (CASES, default 1x1024) under py-spy (.whl/spy), --gil (the thread holding the
            # interpreter lock) and then every active thread: raw stacks under $OUT, read by tools.spy_table (v53)
        base
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        [[ -x /tmp/spy/bin/py-spy ]] || $PY -m pip install -q --no-index --no-deps --target /tmp/spy .whl/spy/*.whl
        for mode in ${SPY_MODES:-gil all}; do
            flag=; [[ $mode == gil ]] && flag=--gil
            mkdir -p "/tmp/spy-$mode" && cp "$BENCH/bandwidth.json" "/tmp/spy-$mode/" 2>/dev/null
            timeout ${TIMEOUT:-280} /tmp/spy/bin/py-spy record --subprocesses --threads --nonblocking $flag -r ${SPY_RATE:-250} \
                -f raw -o "$OUT/spy-$mode.raw" -- $PY -m bench.gpu_bench --out "/tmp/spy-$mode" --model "$BENCH/model" \
                --stages decode --decode-cases ${CASES:-1x1024} --decode-measured-steps ${SPY_STEPS:-3000} 2>&1 \
                | grep -E "^ +[0-9]+ +[0-9]+ +[0-9]|py-spy|rror" | sed "s/^/$mode: /"
            $PY -m tools.spy_table "$OUT/spy-$mode.raw" --rate ${SPY_RATE:-250} --top ${SPY_TOP:-45} | tee "$OUT/spy-$mode.txt" | head -${SPY_LINES:-70}
            gzip -f "$OUT/spy-$mode.raw"
        done
        ;;
    mixed)  # the mixed steps' CUDA graphs (v52): their GPU tests, then the service with WORKER_MIXED_GRAPHS at each of
            # MIXED_ORDER (default "1 0"; run it again for a second pair) in turn, one machine
        base
        TESTS="tests/unit/test_mixed_graphs.py tests/unit/test_gpu_pipelined_runner.py tests/unit/test_cuda_graphs.py" \
            TIMEOUT=240 LINES_OUT=12 bash "$0" tests
        i=0
        for mg in ${MIXED_ORDER:-1 0}; do
            i=$((i + 1))
            WORKER_MIXED_GRAPHS=$mg NAME=mixed-$i-$mg STAGES=${STAGES:-service} EXTRA="--stream-intervals 1 ${EXTRA:-}" \
                TIMEOUT=${TIMEOUT:-200} LINES_OUT=2 bash "$0" bench
            cp "$BENCH/mixed-$i-$mg/service.json" "$OUT/service-mixed-$i-$mg.json" 2>/dev/null
            grep -rah "graphs of prefill and mixed steps\|mixed steps' CUDA graphs\|launch eagerly" "$BENCH/mixed-$i-$mg" | head -2
        done
        service_steps "$OUT" "service-mixed-*.json" "run (graphs)"
        ;;
    kv)     # the service with a bf16 and an FP8 KV cache, side by side (issue 24's ratio)
        base
        for dtype in bfloat16 fp8; do
            QWEN3_SERVE_KV_CACHE_DTYPE=$dtype NAME=kv-$dtype STAGES=service EXTRA="--stream-intervals 1 ${EXTRA:-}" \
                TIMEOUT=${TIMEOUT:-270} LINES_OUT=3 bash "$0" bench
        done
        $PY - "$BENCH" <<'PY'
import json, pathlib, sys
rows = {}
for dtype in ("bfloat16", "fp8"):
    try:
        r = json.loads((pathlib.Path(sys.argv[1]) / f"kv-{dtype}" / "service.json").read_text())["result"]
        rows[dtype] = (r["output_tokens"] / r["seconds"], r["ttft_median_s"] * 1e3, (r["tpot_median_s"] or 0) * 1e3)
        print(f"{dtype:9} {rows[dtype][0]:9.0f} tok/s  TTFT p50 {rows[dtype][1]:6.0f} ms  TPOT p50 {rows[dtype][2]:5.2f} ms")
    except (OSError, KeyError, ValueError) as exc:
        print(f"{dtype:9} no result ({exc!r})")
if len(rows) == 2:
    print(f"fp8 / bf16: {rows['fp8'][0] / rows['bfloat16'][0]:.2f}x tok/s (target 1.15x)")
PY
        ;;
    spec) STAGE=spec NAME=spec bash "$0" stage ;;
    spec-service) STAGE=spec_service NAME=spec_service bash "$0" stage ;;
    moe)
        base
        with_floor moe
        timeout ${TIMEOUT:-420} $PY -m bench.gpu_bench --out "$BENCH/moe" \
            --stages ${STAGES:-moe_kernel,fp8_gemm,moe_e2e,moe_e2e_fp8,decode_8b_bf16,decode_8b_fp8} ${EXTRA:-} 2>&1 | tail -${LINES_OUT:-45}
        copy_logs moe
        ;;
    moe8)   # Qwen3-30B-A3B on bench.py's workload: bf16 and FP8 (the experts' modes measured at start-up),
            # then FP8 by the rows-per-expert rule, and by the rule with every expert GEMM FP8 x FP8
        base
        OUT=$OUT/moe STAGES=moe_e2e,moe_e2e_fp8 LINES_OUT=25 TIMEOUT=${TIMEOUT:-250} bash "$0" moe | grep "fp8\|bf16\|tok/s"
        grep -rh "activation mode by tokens\|activation modes failed" "$BENCH/moe/logs" 2>/dev/null | sed 's/.*INFO //' | head -2
        for rows in 16 0; do
            echo "== WORKER_MOE_FP8_SELECTION=0 WORKER_MOE_FP8_WEIGHT_ONLY_ROWS=$rows"
            WORKER_MOE_FP8_SELECTION=0 WORKER_MOE_FP8_WEIGHT_ONLY_ROWS=$rows OUT=$OUT/moe-rule$rows STAGES=moe_e2e_fp8 \
                LINES_OUT=25 TIMEOUT=${TIMEOUT:-250} bash "$0" moe | grep "fp8\|tok/s"
        done
        echo "== WORKER_MOE_FP8_BITS=0 (weight-only experts convert their weights: v38's A/B)"
        WORKER_MOE_FP8_BITS=0 OUT=$OUT/moe-convert STAGES=moe_e2e_fp8 LINES_OUT=25 TIMEOUT=${TIMEOUT:-250} \
            bash "$0" moe | grep "fp8\|tok/s"
        grep -rh "compiled after start-up" "$BENCH/moe/logs" 2>/dev/null | head -3
        ;;
    fp8)
        base
        run() {   # NAME STAGES EXTRA TIMEOUT; then what the stage logs say of the fused kernels' start-up check or late compiles
            OUT=$OUT/$1 STAGES=$2 EXTRA="$3" LINES_OUT=5 TIMEOUT=$4 bash "$0" moe | grep -v "^ *$"
            grep -rh "start-up check\|compiled after start-up" "$BENCH/moe" 2>/dev/null | head -3
        }
        run b1 bandwidth,decode_8b_bf16,decode_8b_fp8 "--fixed-batch 1 --fixed-steps 256 --fixed-profile" 240   # warm
        # what the start-up selection chose at 1 row for each FP8 kind (v37: the split-K FP8 GEMM or not)
        one_row_choices "$BENCH/moe/logs"
        run b16 decode_8b_bf16,decode_8b_fp8 "--fixed-batch 16 --fixed-steps 256 --fixed-profile" 120
        run on decode_8b_bf16,decode_8b_fp8 "--fixed-batch 256 --fixed-profile" 150
        WORKER_FP8_QUANT_FUSION=0 run off decode_8b_fp8 "--fixed-batch 256" 100
        ;;
    fp8few) # Qwen3-8B decode at 1 row (B1_STAGES: which of bf16 and FP8), with what the selection chose at 1-32
            # rows and every one-row FP8 candidate's time, then the FP8 GEMM's few-row GPU tests (the tiles for
            # wgmma, PERF_NOTES v41); 16 rows with FP8FEW_B16=1
        run() { OUT=$OUT/$1 STAGES=$2 EXTRA="$3" LINES_OUT=5 TIMEOUT=$4 bash "$0" moe | grep -v "^ *$"; }
        run b1 ${B1_STAGES:-bandwidth,decode_8b_bf16,decode_8b_fp8} "--fixed-batch 1 --fixed-steps 256 --fixed-profile" 420   # cold: bf16 ~150 s
        one_row_choices "$BENCH/moe/logs"
        grep -rhao "linear [a-z_]* [0-9x]* fp8 ([0-9]* layers), ms per call by rows: .*" "$BENCH/moe/logs" 2>/dev/null \
            | sed "s/ms per call by rows: 1: [^;]*; //; s/; 64: .*//" | sort -u | head -4
        grep -rhao "linear [a-z_]* [0-9x]* fp8, every candidate's ms per call by rows: 1: [^;]*" "$BENCH/moe/logs" \
            2>/dev/null | sort -u | head -4 > "$OUT/one_row_candidates.txt"
        T=tests/unit/test_fp8_kernels.py   # (the start-up selection checked every candidate's product already)
        TESTS="$T::test_qwen3_8b_shapes_split_over_k_as_the_selection_splits_them $T::test_the_wgmma_tiles_at_a_few_rows_match_the_emulation" \
            TIMEOUT=120 LINES_OUT=4 bash "$0" tests
        [[ -n ${FP8FEW_B16:-} ]] && run b16 decode_8b_bf16,decode_8b_fp8 "--fixed-batch 16 --fixed-steps 256 --fixed-profile" 120
        ;;
    b1ab)   # Qwen3-8B decode at 1 row, bf16 and FP8, on .gpu/ref and on this tree (one machine: the batch-1
            # FP8 question of PERF_NOTES v34), and each tree's start-up choice at 1 row per FP8 kind
        base
        [[ -d .gpu/ref ]] || { echo "no .gpu/ref: run scripts/gpu_ref.sh REF here first" >&2; exit 2; }
        for tree in ref tree; do
            dir=$([[ $tree == ref ]] && echo .gpu/ref || echo .)
            mkdir -p "/tmp/b1-$tree" && cp "$BENCH/bandwidth.json" "/tmp/b1-$tree/" 2>/dev/null
            (cd "$dir" && timeout ${TIMEOUT:-200} $PY -m bench.gpu_bench --out "/tmp/b1-$tree" \
                --stages ${STAGES:-bandwidth,decode_8b_bf16,decode_8b_fp8} --fixed-batch 1 --fixed-steps 256 2>&1 \
                | grep -v "^ *$" | tail -8 | sed "s/^/$tree: /")
            one_row_choices "/tmp/b1-$tree" | sed "s/^/$tree: /"
        done
        ;;
    prof8)  # Qwen3-8B decode-graph kernels a step (profile stage), FP8 at 1/16/256 rows and bf16 at 1/256, context
            # 128: the top kernels and the serial wall time of a step (v38's table)
        for q in fp8 bf16; do
            X="--profile-batches 1,256"; [[ $q == fp8 ]] && X="--profile-quantization fp8 --profile-batches 1,16,256"
            profile_table prof-$q ${TIMEOUT:-200} "--profile-config 8b $X --profile-context 128"
            cp "$OUT/profile.json" "$OUT/profile-$q.json" 2>/dev/null
        done
        ;;
    prof06) # Qwen3-0.6B (the checkpoint stage's seeded weights) decode-graph kernels a step at 1/16/256 rows,
            # context 1024: issue 23's profile table (batch-1 step target 0.8 ms)
        base
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        profile_table prof-06b ${TIMEOUT:-240} "--model $BENCH/model --profile-batches 1,16,256 --profile-context 1024"
        ;;
    depth)
        STAGES=${STAGES:-bandwidth,service,decode} NAME=depth TIMEOUT=${TIMEOUT:-400} LINES_OUT=30 \
            EXTRA="--decode-cases 1x1024,4x1024,16x1024,64x1024,256x1024 --decode-in-flight 2,3 --decode-measured-steps 40 --stream-intervals 1" \
            bash "$0" bench
        ;;
    ab06)
        base
        [[ -d .gpu/ref ]] || { echo "no .gpu/ref: run scripts/gpu_ref.sh REF here first" >&2; exit 2; }
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        for tree in ${AB_ORDER:-ref tree}; do
            dir=$([[ $tree == ref ]] && echo .gpu/ref || echo .)
            rm -rf "/tmp/ab06-$tree" && mkdir -p "/tmp/ab06-$tree" && cp "$BENCH/bandwidth.json" "/tmp/ab06-$tree/" 2>/dev/null
            (cd "$dir" && timeout ${TIMEOUT:-200} $PY -m bench.gpu_bench --out "/tmp/ab06-$tree" --model "$BENCH/model" \
                --stages decode --decode-cases ${CASES:-1x1024,4x1024,16x1024} --decode-measured-steps 60 \
                2>&1 | grep -v "^ *$" | tail -5 | sed "s/^/$tree: /")
        done
        ;;
    longest)
        # first: the order's sort captured in the decode graphs replays the eager forward, and any order
        # gives the same bits (WORKER_ATTENTION_LONGEST_FIRST=1 orders every pure-decode step)
        echo "== tests with WORKER_ATTENTION_LONGEST_FIRST=1"
        WORKER_ATTENTION_LONGEST_FIRST=1 TIMEOUT=150 LINES_OUT=6 TESTS="tests/unit/test_cuda_graphs.py \
            tests/unit/test_attention_backends.py" bash "$0" tests
        STAGE=attention_splits NAME=asplit TIMEOUT=90 LINES_OUT=5 EXTRA="--cases 256 --splits 1 --configs 1" bash "$0" stage
        for n in 0 64; do
            echo "== WORKER_ATTENTION_LONGEST_FIRST=$n"
            WORKER_ATTENTION_LONGEST_FIRST=$n STAGES=${STAGES:-bandwidth,service,decode} NAME=longest-$n TIMEOUT=240 \
                LINES_OUT=24 EXTRA="--decode-cases 64x1024,256x1024 --stream-intervals 1" bash "$0" bench \
                | grep -v "not run\|^ *$\|^==\|ok in\|cpu:"
        done
        ;;
    ashort)
        for heads in 32,8 16,8; do
            STAGE=attention_splits NAME=ashort-${heads/,/-} TIMEOUT=200 LINES_OUT=6 \
                EXTRA="--cases x128 --heads $heads --splits 1,2" bash "$0" stage
            cp "$OUT/attention_splits.json" "$OUT/ashort-${heads/,/-}.json" 2>/dev/null
        done
        ;;
    hfirst)
        STAGE=attention_splits NAME=hf-fp8 TIMEOUT=280 LINES_OUT=16 \
            EXTRA="--kv fp8 --cases 256 --splits 1,2 --heads-first" bash "$0" stage
        cp "$OUT/attention_splits.json" "$OUT/hf-fp8.json" 2>/dev/null
        for heads in 16,8 32,8; do
            STAGE=attention_splits NAME=hf-bf16-${heads/,/-} TIMEOUT=150 LINES_OUT=16 \
                EXTRA="--cases 256 --splits 1 --configs 4 --heads-first --heads $heads" bash "$0" stage
            cp "$OUT/attention_splits.json" "$OUT/hf-bf16-${heads/,/-}.json" 2>/dev/null
        done
        ;;
    ragged)   # ragged contexts at 16/64/256 requests, every launch longest first: the tile configs and splits (v44)
        STAGE=attention_splits NAME=ragged TIMEOUT=170 LINES_OUT=14 \
            EXTRA="--cases ragged --splits 1,2,4 --configs 4 --longest ${EXTRA:-}" bash "$0" stage
        ;;
    pdlchain)   # the layer's kernels as one PDL chain, off and on (v45): the decode stage's device column
        base
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        for n in ${PDL_ORDER:-0 1}; do
            mkdir -p "/tmp/pdl-$n" && cp "$BENCH/bandwidth.json" "/tmp/pdl-$n/" 2>/dev/null
            WORKER_PDL_CHAIN=$n timeout ${TIMEOUT:-200} $PY -m bench.gpu_bench --out "/tmp/pdl-$n" --model "$BENCH/model" \
                --stages decode --decode-cases ${CASES:-1x1024,4x1024,16x1024,64x1024,256x1024} --decode-measured-steps 60 \
                2>&1 | grep -v "^ *$" | tail -${LINES_OUT:-9} | sed "s/^/chain=$n: /"
            cp "/tmp/pdl-$n/decode.json" "$OUT/decode-pdl$n.json" 2>/dev/null
        done
        if [[ -n ${PDL8:-} ]]; then
            for n in 0 1; do
                WORKER_PDL_CHAIN=$n OUT=$OUT/pdl8-$n STAGES=decode_8b_fp8 EXTRA="--fixed-batch 1 --fixed-steps 256" \
                    LINES_OUT=6 TIMEOUT=${TIMEOUT8:-240} bash "$0" moe | grep "Qwen3-\|mean step" | sed "s/^/chain=$n: /"
            done
        fi
        ;;
    wholeslice)   # GEMVs reading their whole weight slice before the PDL wait (v46) up to WS_ORDER's row counts in
                  # turn (WORKER_GEMV_WHOLE_SLICE_ROWS; 0 = off; from 16 rows the tensor-core ones, v50): Qwen3-0.6B
                  # decode at CASES, the one-row choices (WS_HOOK=few_row_linear: those at 16-64 rows);
                  # WS_PROF=1: prof06 with them at one row
        base
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        decode_ab WORKER_GEMV_WHOLE_SLICE_ROWS ws "${WS_ORDER:-0 1 1 0}" "${CASES:-1x1024,2x1024,4x1024,16x1024}" \
            "${WS_HOOK:-one_row_linear}"
        if [[ -n ${WS_PROF:-} ]]; then
            WORKER_GEMV_WHOLE_SLICE_ROWS=1 PROFILE_LINES=30 profile_table prof-ws \
                ${TIMEOUT:-200} "--model $BENCH/model --profile-batches 1 --profile-context 1024"
        fi
        ;;
    decodeqk)   # pure-decode attention launches taking the raw qkv projection (q/k norm, RoPE and the K/V store in the
                # launch, WORKER_ATTENTION_DECODE_QK_ROWS, PERF_NOTES v48, v50) at each row bound of QK_ORDER: Qwen3-0.6B decode
                # at CASES; QK_TESTS=1 first runs its GPU tests; QK_PROF=1 adds prof06 with it at one row
        base
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        if [[ -n ${QK_TESTS:-} ]]; then
            TESTS=${QK_TEST_FILES:-"tests/unit/test_decode_qk.py tests/unit/test_triton_decode_kernel.py tests/unit/test_fused_kernels.py
                tests/unit/test_gemv_kernels.py::test_a_decode_layer_as_one_pdl_chain_replays_as_plain_launches"} \
                LINES_OUT=8 TIMEOUT=200 bash "$0" tests
        fi
        decode_ab WORKER_ATTENTION_DECODE_QK_ROWS qk "${QK_ORDER:-0 64 0 64}" "${CASES:-1x1024,16x1024,64x1024,128x1024,256x1024}"
        if [[ -n ${QK_PROF:-} ]]; then
            PROFILE_LINES=30 profile_table prof-qk \
                ${TIMEOUT:-200} "--model $BENCH/model --profile-batches 1 --profile-context 1024"
        fi
        ;;
    ws8)    # Qwen3-8B FP8 decode at one row with the whole-slice GEMVs allowed for FP8 weights up to each bound of
            # WS8_MIB (WORKER_GEMV_WHOLE_SLICE_FP8_MAX_MIB; 0 = none, the default): o 16 MiB, qkv 24, down 48, gate_up
            # 96, the FP8 LM head 594 (with WS8_HEAD=1), one machine; each run's one-row choices (PERF_NOTES v47)
        base
        head=""; [[ -n ${WS8_HEAD:-} ]] && head="--fixed-lm-head-dtype fp8"
        for mib in ${WS8_MIB:-0 32 0 32}; do
            WORKER_GEMV_WHOLE_SLICE_FP8_MAX_MIB=$mib OUT=$OUT/ws8-$mib STAGES=decode_8b_fp8 \
                EXTRA="--fixed-batch 1 --fixed-steps 256 $head" LINES_OUT=6 TIMEOUT=${TIMEOUT:-240} bash "$0" moe \
                | grep "Qwen3-\|mean step" | sed "s/^/fp8 bound $mib MiB: /"
            one_row_choices "$BENCH/moe/logs" | sed "s/^/fp8 bound $mib MiB: /"
            rm -rf "$BENCH/moe/logs"
        done
        ;;
    pdlservice)   # the service with the decode layer's PDL chain off and on (v45), one machine
        for n in ${PDL_ORDER:-0 1}; do
            echo "== WORKER_PDL_CHAIN=$n"
            WORKER_PDL_CHAIN=$n STAGES=${STAGES:-bandwidth,service} NAME=pdls-$n TIMEOUT=${TIMEOUT:-260} \
                LINES_OUT=24 EXTRA="--stream-intervals 1 ${EXTRA:-}" bash "$0" bench | grep -v "not run\|^ *$\|^==\|ok in\|cpu:"
        done
        ;;
    hfservice)   # the service with its pure-decode launches kv heads first and not (PERF_NOTES v44), one machine
        for n in 0 1; do
            echo "== WORKER_ATTENTION_HEADS_FIRST=$n"
            WORKER_ATTENTION_HEADS_FIRST=$n STAGES=${STAGES:-bandwidth,service} NAME=hfs-$n TIMEOUT=${TIMEOUT:-260} \
                LINES_OUT=24 EXTRA="--stream-intervals 1 ${EXTRA:-}" bash "$0" bench | grep -v "not run\|^ *$\|^==\|ok in\|cpu:"
        done
        ;;
    fp8head)   # the LM head in FP8 (--lm-head-dtype fp8) at 1, 16 and 256 rows (HEAD_ROWS), Qwen3-8B FP8 decode
        base
        for rows in ${HEAD_ROWS:-1 16 256}; do
            OUT=$OUT/head$rows STAGES=decode_8b_fp8 EXTRA="--fixed-batch $rows --fixed-steps 256 --fixed-lm-head-dtype fp8" \
                LINES_OUT=6 TIMEOUT=${TIMEOUT:-200} bash "$0" moe | grep "Qwen3-\|mean step"
        done
        ;;
    aconf)  # the bf16 decode attention's tile (WORKER_ATTENTION_DECODE_TILE "KV_TILE,WARPS,STAGES", each of AC_TILES) and
            # programs per SM (WORKER_ATTENTION_DECODE_WARPS_PER_SM, each of AC_WPS) in the decode chain, in turn, one machine:
            # Qwen3-0.6B pipelined decode at CASES (default 16/64 x 1024; v56)
        base
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        [[ -n ${AC_TILES:-} ]] && decode_ab WORKER_ATTENTION_DECODE_TILE tile "$AC_TILES" "${CASES:-16x1024,64x1024}"
        [[ -n ${AC_WPS:-} ]] && decode_ab WORKER_ATTENTION_DECODE_WARPS_PER_SM wps "$AC_WPS" "${CASES:-16x1024,64x1024}"
        true
        ;;
    smallgemm)   # cuBLAS against a plain Triton GEMM on the projections at 64-512 rows (bench/probes/small_gemm.py, v56):
                 # SG_ROWS (default 64,128,256,512), SG_MODELS (default 0.6b,8b)
        base
        timeout ${TIMEOUT:-300} $PY -m bench.probes.small_gemm --rows "${SG_ROWS:-64,128,256,512}" --models "${SG_MODELS:-0.6b,8b}" 2>&1 \
            | tee "$OUT/small_gemm.txt" | tail -${LINES_OUT:-40}
        ;;
    ncu)    # a decode step's kernels under Nsight Compute's counters (bench/probes/ncu_decode.py, v56): Qwen3-0.6B at
            # NCU_BATCHES (default "1 16 64") x 1024, then (NCU8=1) Qwen3-8B FP8 at NCU8_BATCHES (default 1); tables here,
            # CSVs under $OUT
        base
        [[ -f $BENCH/model/config.json ]] || bash "$0" checkpoint
        NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        copy=$($PY -c "import json; print(json.load(open('$BENCH/bandwidth.json'))['result']['copy_bytes_per_s'] / 1e12)" 2>/dev/null || echo 0)
        ncu_case() {   # TAG, then the probe's run arguments: once alone (its kernels compiled into Triton's cache,
                       # its start-up timed), then under ncu, whose start-up is far slower (v56: past 180 s at 16 rows)
            local tag=$1; shift
            local started=$SECONDS
            timeout 300 $PY -m bench.probes.ncu_decode run "$@" 2>&1 | tail -2
            echo "$tag alone: $((SECONDS - started)) s"
            timeout ${TIMEOUT:-420} "$NCU_BIN" --profile-from-start off --clock-control none --target-processes application-only \
                --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
                --section MemoryWorkloadAnalysis --launch-count ${NCU_COUNT:-80} --export "/tmp/ncu-$tag" --force-overwrite \
                $PY -m bench.probes.ncu_decode run "$@" 2>&1 | grep -v "^==PROF==" | tail -3
            "$NCU_BIN" --import "/tmp/ncu-$tag.ncu-rep" --csv --page raw > "/tmp/ncu-$tag.csv" 2>/dev/null
            gzip -c "/tmp/ncu-$tag.csv" > "$OUT/ncu-$tag.csv.gz"
            echo "== $tag"
            $PY -m bench.probes.ncu_decode table "/tmp/ncu-$tag.csv" --copy-tbs "$copy" | head -${NCU_LINES:-16}
        }
        for b in ${NCU_BATCHES:-1 16 64}; do
            ncu_case "06-b$b" --model "$BENCH/model" --batch "$b"
        done
        if [[ -n ${NCU8:-} ]]; then
            $PY -c "import pathlib; from bench.model_dirs import write_config_dir; write_config_dir(pathlib.Path('$BENCH/m8b'), pathlib.Path('configs/qwen3-8b.json'))"
            for b in ${NCU8_BATCHES:-1}; do
                ncu_case "8b-fp8-b$b" --model "$BENCH/m8b" --batch "$b" --load-format dummy --quantization fp8
            done
        fi
        ;;
    stage)
        base
        NAME=${NAME:-$STAGE}
        mkdir -p "$BENCH/$NAME"
        timeout ${TIMEOUT:-400} $PY -m bench.stages.$STAGE --out "$BENCH/$NAME" ${EXTRA:-} 2>&1 | tail -${LINES_OUT:-40}
        cp "$BENCH/$NAME"/*.json "$BENCH/$NAME"/*.json.gz "$OUT/" 2>/dev/null; true
        ;;
    ab)
        base
        [[ -d .gpu/ref ]] || { echo "no .gpu/ref: run scripts/gpu_ref.sh REF here first" >&2; exit 2; }
        echo "== .gpu/ref ($STAGE)"
        (cd .gpu/ref && OUT=$OUT/ref BENCH=/tmp/bench-ref NAME=$STAGE bash bench/gpu_session.sh stage)
        echo "== this tree ($STAGE)"
        OUT=$OUT/tree BENCH=/tmp/bench-tree NAME=$STAGE bash "$0" stage
        ;;
    spec-ab)
        base
        [[ -d .gpu/ref ]] || { echo "no .gpu/ref: run scripts/gpu_ref.sh REF here first" >&2; exit 2; }
        mkdir -p "$OUT/ref"
        SPEC_STAGE=${SPEC_STAGE:-spec}
        (cd .gpu/ref && OUT=$OUT/ref BENCH=/tmp/bench-ref TIMEOUT=${TIMEOUT:-270} LINES_OUT=2 \
            EXTRA="${REF_EXTRA:-${EXTRA:-}}" STAGE=$SPEC_STAGE NAME=$SPEC_STAGE bash bench/gpu_session.sh stage)
        TIMEOUT=${TIMEOUT:-270} LINES_OUT=${LINES_OUT:-60} STAGE=$SPEC_STAGE NAME=$SPEC_STAGE bash "$0" stage
        $PY - "$OUT/ref/$SPEC_STAGE.json" "$OUT/$SPEC_STAGE.json" <<'PY'
import json, sys
rows = []
for path in sys.argv[1:]:
    try:
        rows.append({(r["proposer"], r["batch"]): r for r in json.load(open(path))["result"]["rows"]})
    except (OSError, KeyError, ValueError) as exc:
        rows.append({})
        print(f"{path}: no result ({exc!r})")
ref, new = rows
print(f"{'proposer':16s} {'batch':>5s} {'ref ms':>8s} {'tree ms':>8s} {'tree/ref':>8s}")
for key in sorted(set(ref) & set(new), key=lambda k: (k[0] != "none", k)):
    a, b = ref[key]["step_ms"], new[key]["step_ms"]
    print(f"{key[0]:16s} {key[1]:5d} {a:8.2f} {b:8.2f} {b / a:8.3f}")
PY
        ;;
    *) echo "usage: $0 base|tests|smoke|checkpoint|fa4|stash|bench|kv|spec|spec-service|moe|moe8|fp8|prof8|prof06|depth|ab06|longest|ashort|hfirst|ragged|hfservice|fp8head|ws8|wholeslice|pdlchain|b1ab|stage|ab|spec-ab" >&2; exit 2 ;;
esac
