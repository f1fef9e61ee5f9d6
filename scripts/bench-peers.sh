#!/usr/bin/env bash
# Install the lazy-pulling peer of the benchmarks (benchmarks/stargz_peer.py), as root:
# containerd, ctr-remote and a stargz snapshotter daemon built offline from Debian's Go sources.
# Called by `scripts/setup.sh --test` (make test, CI: the peer's smoke test) and `--bench`; only
# benchmarks/ code runs these, so the project's list (scripts/debian-packages.txt) does not hold
# them: scripts/bench-packages.txt does.
# Idempotent, and quick when everything is in place: apt runs only for missing packages, go
# only when the daemon's source or the Debian library changed.
#
# Debian 12 ships the snapshotter library and ctr-remote but not the daemon
# (containerd-stargz-grpc), so benchmarks/stargz_grpc/main.go composes one from the library.
# The build is GOPATH-style over /usr/share/gocode (GO111MODULE=off, GOPROXY=off): nothing is
# downloaded but Debian packages.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mapfile -t BENCH_PACKAGES < <(sed -e 's/#.*//' scripts/bench-packages.txt | awk 'NF {print $1}')
CACHE=${WEENV_BENCH_CACHE:-/var/cache/weenv-bench}
BIN=$CACHE/bin/stargz-grpc
SOURCE=benchmarks/stargz_grpc/main.go
LIBRARY=golang-github-containerd-stargz-snapshotter-dev

log() { printf 'bench-peers: %s\n' "$*" >&2; }

# shellcheck source=scripts/apt.sh
source scripts/apt.sh

build_key() {
    { sha256sum "$SOURCE"; dpkg-query -W -f='${Version}\n' "$LIBRARY" golang-go containerd; } \
        | sha256sum | cut -d' ' -f1
}

build_snapshotter() {
    local key gopath
    key=$(build_key)
    if [[ -x $BIN && -f $BIN.key && $(cat "$BIN.key") == "$key" ]]; then
        log "$BIN up to date"
        return
    fi
    log "building $BIN from $SOURCE and Debian's $LIBRARY (offline)"
    gopath=$CACHE/gopath
    rm -rf "$gopath"
    mkdir -p "$gopath/src/weenvbench/stargz-grpc" "$CACHE/bin"
    cp "$SOURCE" "$gopath/src/weenvbench/stargz-grpc/main.go"
    (
        cd "$gopath/src/weenvbench/stargz-grpc"
        GO111MODULE=off GOPATH=$gopath:/usr/share/gocode GOPROXY=off GOFLAGS= \
            GOCACHE=$CACHE/gocache go build -o "$BIN.tmp" .
    )
    mv "$BIN.tmp" "$BIN"
    echo "$key" >"$BIN.key"
    rm -rf "$gopath"
}

install_missing "${BENCH_PACKAGES[@]}"
build_snapshotter
