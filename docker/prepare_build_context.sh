#!/usr/bin/env bash
# Puts into the Docker build context what this machine has and a registry-less build needs;
# both folders are git-ignored and empty in a normal checkout, where the Dockerfile does without.
#   docker/ca-certificates/  the machine's locally added CA certificates, trusted only while the
#                            build stage runs pip (TLS to the package index goes through them);
#   docker/wheelhouse/       the torch wheel pinned in requirements.txt, as this machine's pip
#                            finds it (a CPU build kept on disk), instead of PyPI's CUDA build.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}

ca_dir=$REPO/docker/ca-certificates
find "$ca_dir" -name '*.crt' -delete
find /usr/local/share/ca-certificates -name '*.crt' -exec cp {} "$ca_dir/" \; 2>/dev/null || true

torch_pin=$(grep -E '^torch==' "$REPO/requirements.txt")
wheel_dir=$REPO/docker/wheelhouse
if ! ls "$wheel_dir"/torch-"${torch_pin#torch==}"*.whl >/dev/null 2>&1; then
    find "$wheel_dir" -name 'torch-*.whl' -delete
    "$PYTHON" -m pip download --quiet --no-deps "$torch_pin" -d "$wheel_dir" \
        2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
fi
# Docker's layer cache keys on modes too: make them the same whatever umask made the checkout.
chmod 755 "$ca_dir" "$wheel_dir"
find "$ca_dir" "$wheel_dir" -type f -exec chmod 644 {} +
echo "prepare_build_context: $(find "$ca_dir" -name '*.crt' | wc -l) CA certificate(s)," \
    "$(cd "$wheel_dir" && ls torch-*.whl)"
