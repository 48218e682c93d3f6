#!/usr/bin/env bash
# Downloads the FlashAttention-4 wheel set (the pins in requirements-gpu.txt) for an offline
# GPU machine: Python 3.12, manylinux x86_64. The set (~98 MiB) lands in two
# folders, .whl/fa4a and .whl/fa4b, each under 60 MiB so that each can travel on its own: the one
# large wheel (nvidia-cutlass-dsl-libs-cu13, ~88 MiB) is cut in two with `split -b`, one part per
# folder, and scripts/fa4_install.sh puts it back together with `cat` on the GPU machine (and
# checks it against the sha256 written here).
#
#   scripts/fa4_wheels.sh [PYTHON]     # PYTHON: the interpreter whose pip downloads (default python3)
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${1:-python3}
A=.whl/fa4a
B=.whl/fa4b
LIMIT=$((60 * 1024 * 1024))

# name==version, read from requirements-gpu.txt so the two never disagree.
pins() { grep -E "^$1==" requirements-gpu.txt; }

download() {   # download DIR PIN [platform-specific]
    local dir=$1 pin=$2
    if [[ ${3:-} == binary ]]; then
        "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$pin"
    else
        "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d "$dir" "$pin"
    fi
}

rm -rf "$A" "$B"
mkdir -p "$A" "$B"

# The pure-Python wheels and the two smaller CUTLASS DSL libraries.
for name in flash-attn-4 quack-kernels nvidia-cutlass-dsl einops; do
    download "$A" "$(pins "$name")"
done
for name in apache-tvm-ffi torch-c-dlpack-ext nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core; do
    download "$A" "$(pins "$name")" binary
done

# The CUDA 13 library wheel, in two halves: part00 beside the small wheels, part01 alone.
download "$B" "$(pins nvidia-cutlass-dsl-libs-cu13)" binary
big=$(ls "$B"/nvidia_cutlass_dsl_libs_cu13-*.whl)
name=$(basename "$big")
(cd "$B" && sha256sum "$name" > "$name.sha256")
half=$(( ($(stat -c %s "$big") + 1) / 2 ))
split -b "$half" -d "$big" "$B/$name.part"
mv "$B/$name.part00" "$A/"
rm "$big"

status=0
for dir in "$A" "$B"; do
    size=$(du -sb "$dir" | cut -f1)
    printf '%s: %d files, %.1f MiB\n' "$dir" "$(ls "$dir" | wc -l)" "$(echo "$size / 1048576" | bc -l)"
    if (( size >= LIMIT )); then
        echo "error: $dir is $size bytes, over the 60 MiB a folder may carry" >&2
        status=1
    fi
done
ls -l "$A" "$B"
exit $status
