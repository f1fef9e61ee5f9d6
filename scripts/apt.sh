# Installing Debian packages, shared by setup.sh and bench-peers.sh (sourced; the caller
# defines `log`). `install_missing PKG...` installs those not installed yet, after
# `apt-get update`, as root; without root it names them and exits 1.

is_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'
}

install_missing() {
    local missing=() pkg
    for pkg in "$@"; do
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
