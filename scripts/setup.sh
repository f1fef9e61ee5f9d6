#!/usr/bin/env bash
# Install what WeEnv needs on a fresh Debian 12 machine, as root: Debian packages, then the
# dev venv .venv with an editable install of the project and its test tools.
# `setup.sh --bench` adds what the benchmarks compare against and draw with: Debian's
# docker.io (dockerd, started by the benchmarks themselves) and matplotlib.
# Idempotent, and quick when everything is in place: apt runs only for missing packages and
# pip only when pyproject.toml changed (or the install is broken).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Debian packages the project uses. Add new ones here (one list for Makefile and .ci/run).
DEBIAN_PACKAGES=(
    fuse3 libfuse3-dev pkg-config gcc  # FUSE, and building pyfuse3 from source
    debootstrap zstd attr              # sample environments, inspecting blobs and xattrs
    docker-registry skopeo umoci       # weenv convert tests: a real registry, pushing, unpacking
    iproute2                           # network namespaces and veths (distributed store tests)
    runc catatonit bubblewrap          # sandboxes: OCI runtime, its init; bwrap as a benchmark baseline
)
BENCH_DEBIAN_PACKAGES=(docker.io)     # the Docker peer of the runtime/prefetch/cold-start benchmarks
EXTRAS=test
if [[ ${1:-} == --bench ]]; then
    DEBIAN_PACKAGES+=("${BENCH_DEBIAN_PACKAGES[@]}")
    EXTRAS=test,bench
fi
PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.weenv-setup-stamp

log() { printf 'setup: %s\n' "$*" >&2; }

is_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'
}

python_lacks_venv() {
    # Debian's python3 ships venv/ensurepip separately (python3-venv); pyenv builds have it.
    ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1
}

python_lacks_headers() {
    # pyfuse3 compiles against Python.h (python3-dev for Debian's python3).
    ! "$PYTHON" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
}

install_debian_packages() {
    local wanted=("${DEBIAN_PACKAGES[@]}") missing=() pkg
    if python_lacks_venv; then wanted+=(python3-venv); fi
    if python_lacks_headers; then wanted+=(python3-dev); fi
    for pkg in "${wanted[@]}"; do
        is_installed "$pkg" || missing+=("$pkg")
    done
    if ((${#missing[@]} == 0)); then
        log "Debian packages present"
        return
    fi
    if [[ $(id -u) -ne 0 ]]; then
        log "missing Debian packages: ${missing[*]}; run as root to install them"
        exit 1
    fi
    log "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
}

stamp_value() {
    { "$PYTHON" -VV; cat pyproject.toml; echo "$EXTRAS"; } | sha256sum | cut -d' ' -f1
}

install_venv() {
    if [[ -d $VENV ]] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
        log "removing broken $VENV"
        rm -rf "$VENV"
    fi
    if [[ ! -d $VENV ]]; then
        log "creating $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    local want
    want=$(stamp_value)
    if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]] \
        && "$VENV/bin/python" -c 'import weenvfs.cli' >/dev/null 2>&1 \
        && [[ -x $VENV/bin/weenv ]]; then
        log "$VENV up to date"
        return
    fi
    log "installing the project into $VENV (editable, extras: $EXTRAS)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
    echo "$want" >"$STAMP"
}

install_debian_packages
install_venv
