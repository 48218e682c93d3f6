#!/usr/bin/env bash
# Writes another tree (a git ref, default main) under .gpu/ref for bench/gpu_session.sh spec-ab, which
# runs the spec stage on it and on the working tree in one device call (carry [".whl", ".gpu"]).
set -euo pipefail
ref=${1:-main}
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
rm -rf .gpu/ref && mkdir -p .gpu/ref
git archive "$ref" | tar x -C .gpu/ref
ln -s ../../.whl .gpu/ref/.whl
echo ".gpu/ref: $(git rev-parse --short "$ref") ($ref)"
