#!/usr/bin/env bash
# Device side of the block-FP8 GEMM probe (PERF_NOTES v28): `bash bench/probes/fp8_block_gemm.sh`, carry [".whl"].
# The wheels, downloaded here once: pip download --no-deps --python-version 3.12 --only-binary=:all: -d .whl/fp8probe
#   sgl-deep-gemm==0.1.5.post1 sgl-deep-gemm==0.2.5 apache-tvm-ffi==0.1.11 apache-tvm-ffi==0.1.15.post2
# They are installed into /tmp/site_* (no venv touched); the probe prints its table to stdout and $OUT/probe.log.
set -o pipefail
W=.whl/fp8probe
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_a $W/sgl_deep_gemm-0.1.5.post1-*.whl $W/apache_tvm_ffi-0.1.15.post2-*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_b $W/sgl_deep_gemm-0.1.5.post1-*.whl $W/apache_tvm_ffi-0.1.11-*.whl
# 0.2.5: TORCH_LIBRARY build (no tvm-ffi) made for a newer torch; import-only check of its ABI on 2.11
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_c $W/sgl_deep_gemm-0.2.5-*.whl
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=/tmp/dg_cache
[ -z "$CUDA_HOME" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
# Which tvm-ffi can DeepGEMM load with? (0.1.15.post2 is the one FA4 pins in requirements-gpu.txt)
for s in a b c; do PYTHONPATH=/tmp/site_$s python3 -c "import deep_gemm, importlib.metadata as m; print('site_$s: deep_gemm', deep_gemm.__version__, 'imports OK', [d.metadata['Name']+' '+d.version for d in m.distributions(path=['/tmp/site_$s'])])" 2>&1 | tail -2; done
SITE=/tmp/site_a; PYTHONPATH=/tmp/site_a python3 -c "import deep_gemm" 2>/dev/null || SITE=/tmp/site_b
PYTHONPATH=$SITE timeout 560 python3 bench/probes/fp8_block_gemm.py all 2>&1 | tee $OUT/probe.log
