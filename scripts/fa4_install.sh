#!/usr/bin/env bash
# Installs the FlashAttention-4 wheel set that scripts/fa4_wheels.sh downloaded, on a GPU machine
# without internet, into a plain folder (default /tmp/site) beside an existing torch install:
#
#   scripts/fa4_install.sh [--python PY] [--site DIR] WHEEL_DIR...   # e.g. .whl/fa4a .whl/fa4b
#   source DIR/fa4_env.sh                                             # then python sees flash_attn.cute
#
# The wheels' layout quirks, handled here:
# - The large nvidia-cutlass-dsl-libs-cu13 wheel arrives as two parts; `cat` rejoins them and its
#   sha256 is checked.
# - The three nvidia-cutlass-dsl-libs-* wheels all write into one folder (nvidia_cutlass_dsl), and
#   a second `pip install --target` into the same folder refuses to overwrite it: each wheel goes
#   into a target of its own and the targets are copied over each other (cu13 last).
# - `cutlass` is put on the path by a .pth file, which PYTHONPATH does not process: fa4_env.sh
#   adds the folder that .pth names (nvidia_cutlass_dsl/dsl_packages) to PYTHONPATH itself.
set -euo pipefail

PYTHON=/opt/torch/.venv/bin/python3
SITE=/tmp/site
dirs=()
while (($#)); do
    case $1 in
        --python) PYTHON=$2; shift 2 ;;
        --site) SITE=$2; shift 2 ;;
        *) dirs+=("$1"); shift ;;
    esac
done
if ((${#dirs[@]} == 0)); then
    dirs=(.whl/fa4a .whl/fa4b)
fi
[[ -x $PYTHON ]] || PYTHON=$(command -v python3)

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for d in "${dirs[@]}"; do
    cp "$d"/* "$stage"/
done

# Rejoin the split wheel(s) and check them against the sha256 written when they were split.
for first in "$stage"/*.whl.part00; do
    [[ -e $first ]] || continue
    whl=${first%.part00}
    cat "$whl".part* > "$whl"
    rm "$whl".part*
    if [[ -e $whl.sha256 ]]; then
        (cd "$stage" && sha256sum -c --quiet "$(basename "$whl").sha256")
    fi
done
if ls "$stage"/*.part* >/dev/null 2>&1; then
    echo "error: a wheel part has no part00 beside it: $(ls "$stage"/*.part*)" >&2
    exit 1
fi

install_wheel() {   # install_wheel WHEEL TARGET: pip if the interpreter has it, else unzip (no wheel here has .data)
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m pip install --quiet --no-deps --no-index --target "$2" "$1"
    else
        "$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$1" "$2"
    fi
}

rm -rf "$SITE"
mkdir -p "$SITE"
targets=$(mktemp -d)
# Order matters for the shared nvidia_cutlass_dsl folder: base, core, then the CUDA 13 libraries.
for whl in $(ls "$stage"/*.whl | grep -v libs_cu13) $(ls "$stage"/*libs_cu13*.whl); do
    target="$targets/$(basename "$whl" .whl)"
    install_wheel "$whl" "$target"
    cp -r "$target"/. "$SITE"/
done
rm -rf "$targets"

cat > "$SITE/fa4_env.sh" <<EOF
# Puts the FlashAttention-4 set installed in $SITE on this shell's Python path.
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}
EOF
# shellcheck disable=SC1091
source "$SITE/fa4_env.sh"
"$PYTHON" - <<'EOF'
import flash_attn.cute
import cutlass
import torch
print(f"import flash_attn.cute OK (cutlass-dsl {cutlass.__version__}, torch {torch.__version__}, "
      f"cuda {torch.version.cuda}, device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'})")
EOF
