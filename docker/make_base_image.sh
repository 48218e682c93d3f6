#!/usr/bin/env bash
# Builds, without any container registry, the base image the Dockerfile starts FROM.
#
# With a registry, `docker build` pulls python:3.11-slim-bookworm. Machines that reach only
# Debian's apt repositories build an equivalent image instead: a minimal bookworm root file
# system with Debian's python3 (3.11) made by mmdebstrap, piped into `docker import` and tagged
# with the name the Dockerfile's FROM uses, so the Dockerfile stays the one users build.
#
# The apt mirrors are read from this machine's /etc/apt/sources.list* at run time: the repo
# names no mirror host.
#
#   docker/make_base_image.sh [TAG]     (default python:3.11-slim-bookworm; uses $DOCKER or docker)
set -euo pipefail

TAG=${1:-python:3.11-slim-bookworm}
DOCKER=${DOCKER:-docker}

mirrors=()
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    # mmdebstrap pastes a file given as MIRROR into the chroot's sources (one-line or deb822).
    [[ -s $f ]] && grep -qE '^[[:space:]]*(deb|Types:)' "$f" && mirrors+=("$f")
done
if ((${#mirrors[@]} == 0)); then
    echo "make_base_image: no apt sources found under /etc/apt" >&2
    exit 1
fi

# python-is-python3 gives the `python` command the official image has; docs, man pages and
# locales are left out as in the slim images.
mmdebstrap --variant=minbase --quiet \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm - "${mirrors[@]}" |
    "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        - "$TAG" >/dev/null
echo "make_base_image: built $TAG ($("$DOCKER" image inspect --format '{{.Size}}' "$TAG" | numfmt --to=iec))"
