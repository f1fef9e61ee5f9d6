#!/usr/bin/env bash
# Install what WeEnv needs on a fresh Debian 12 machine, as root: Debian packages, then the
# dev venv .venv with an editable install of the project and its test tools.
# Every Debian package is installed, those only the benchmarks or tests run included (docker.io:
# the Docker peer, which tests of the benchmarks run too). `setup.sh --test` (make test, CI) adds
# the lazy-pulling peer (scripts/bench-peers.sh), whose smoke test is part of the suite;
# `setup.sh --bench` adds that and matplotlib.
# Idempotent, and quick when everything is in place: apt runs only for missing packages and
# pip only when pyproject.toml changed (or the install is broken).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Every Debian package the project, its tests and its benchmarks run: one list, in
# scripts/debian-packages.txt (scripts/check_requirements.py checks it against the code).
mapfile -t DEBIAN_PACKAGES < <(sed -e 's/#.*//' scripts/debian-packages.txt | awk 'NF {print $1}')
PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.weenv-setup-stamp

log() { printf 'setup: %s\n' "$*" >&2; }

EXTRAS=test
BENCH_EXTRAS=test,bench  # matplotlib too, for the benchmarks' figures
PEERS=no
case ${1:-} in
    --test) PEERS=yes ;;
    --bench) PEERS=yes EXTRAS=$BENCH_EXTRAS ;;
    '') ;;
    -h | --help)
        cat <<'USAGE'
usage: bash scripts/setup.sh [--test | --bench]
Install WeEnv's Debian packages, the .venv (editable) and its native programs, as root.
  --test   also the eStargz peer a test of the benchmarks runs (make test, CI)
  --bench  that and matplotlib, for the benchmarks' figures (make bench-setup)
examples:
  bash scripts/setup.sh            # what make demo runs
  bash scripts/setup.sh --test     # what make test and .ci/run run
USAGE
        exit 0 ;;
    *) log "unknown option $1 (--test: with the eStargz peer; --bench: that and matplotlib)"; exit 2 ;;
esac

# shellcheck source=scripts/apt.sh
source scripts/apt.sh

python_lacks_venv() {
    # Debian's python3 ships venv/ensurepip separately (python3-venv); pyenv builds have it.
    ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1
}

python_lacks_headers() {
    # pyfuse3 compiles against Python.h (python3-dev for Debian's python3).
    ! "$PYTHON" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
}

# Compile every module of the project and the venv once, so that no run pays for it: where
# PYTHONDONTWRITEBYTECODE is set (as on our machines) Python never writes .pyc files itself, and
# `weenv version` then recompiled every module it imports on every run (~150 ms more).
compile_python() {
    log "compiling the project's and the venv's Python modules"
    "$VENV/bin/python" -m compileall -q -j 0 weenvfs format tools "$VENV/lib" >/dev/null || true
}

install_debian_packages() {
    local wanted=("${DEBIAN_PACKAGES[@]}")
    if python_lacks_venv; then wanted+=(python3-venv); fi
    if python_lacks_headers; then wanted+=(python3-dev); fi
    install_missing "${wanted[@]}"
}

stamp_value() {  # of the install with extras $1
    { "$PYTHON" -VV; cat pyproject.toml; echo "$1"; } | sha256sum | cut -d' ' -f1
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
    local want have=
    want=$(stamp_value "$EXTRAS")
    [[ -f $STAMP ]] && have=$(cat "$STAMP")
    # An install with the benchmarks' extras serves the tests too (make test after make
    # bench-setup installed nothing again).
    if [[ -n $have && ( $have == "$want" || $have == $(stamp_value "$BENCH_EXTRAS") ) ]] \
        && "$VENV/bin/python" -c 'import weenvfs.cli' >/dev/null 2>&1 \
        && [[ -x $VENV/bin/weenv ]]; then
        log "$VENV up to date"
        return
    fi
    log "installing the project into $VENV (editable, extras: $EXTRAS)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
    echo "$want" >"$STAMP"
}

# The native programs, installed next to the venv's python, where the code looks for them
# (weenvfs/native_programs.py); each built again when its source is newer: the kernel path's
# server of data devices (native/weenv-devserve.c; without it mounts serve their devices
# from Python, `weenv stats`: device_server) and the private cgroup view crun runs in on a
# hybrid cgroup host (native/weenv-cgroup-view.c; without it, unshare, sh and umount), and
# the init of the sandbox a warm `weenv run` finds started ahead (native/weenv-standby.c,
# static: it runs inside any image; without it, every run starts its sandbox itself).
build_native() {
    local name source target extra
    for name in weenv-devserve weenv-cgroup-view weenv-standby; do
        source=native/$name.c target=$VENV/bin/$name extra=()
        if [[ $name == weenv-devserve ]]; then
            mapfile -t extra < <(bash native/decode-flags.sh)  # its fetching: zstd, BLAKE3
        elif [[ $name == weenv-standby ]]; then
            extra=(-static)
        fi
        if [[ -x $target && $target -nt $source && ( $name != weenv-devserve || $target -nt native/decode-flags.sh ) ]]; then
            continue
        fi
        log "building $target"
        gcc -O2 -Wall -Wextra -Wno-unused-parameter -o "$target.tmp" "$source" "${extra[@]}"
        mv "$target.tmp" "$target"
    done
}

# The `weenv` command itself (native/weenv-launch.c): it hands a `weenv run` or `pull` to the node
# service without starting Python (~30 ms less per warm run) and runs `python -m weenvfs`
# for everything else. It replaces the console script pip wrote (the same entry point), with
# the interpreter and code folders the service's code check compares baked in; built every
# time (~0.2 s), since pip rewrites the script whenever it installs again.
build_launcher() {
    local source=native/weenv-launch.c target=$VENV/bin/weenv found
    mapfile -t found < <("$VENV/bin/python" -c 'import sys
from weenvfs.fuse import node_socket as n
for v in (sys.executable, n.PACKAGE, ":".join(n._code_folders())):
    print(chr(34) + v.replace(chr(92), 2 * chr(92)).replace(chr(34), chr(92) + chr(34)) + chr(34))')
    gcc -O2 -Wall -Wextra -Wno-unused-parameter -DWEENV_PYTHON="${found[0]}" \
        -DWEENV_PACKAGE="${found[1]}" -DWEENV_CODE_DIRS="${found[2]}" \
        -o "$target.tmp" "$source"
    mv "$target.tmp" "$target"
}

install_debian_packages
if [[ $PEERS == yes ]]; then
    # After the project's packages: the snapshotter build is keyed on containerd's version.
    bash scripts/bench-peers.sh  # the stargz snapshotter (scripts/bench-packages.txt)
fi
install_venv
build_native
build_launcher
compile_python
