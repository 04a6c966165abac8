#!/usr/bin/env bash
# Install or upgrade scratchd as a systemd service. Idempotent: run it again to upgrade.
#
#   sudo scripts/install-systemd.sh [options] [SOURCE]
#
# SOURCE is what pip installs (default: this checkout), e.g. a wheel file.
#   --prefix DIR      install root of the releases (default /opt/scratchd)
#   --extras LIST     pip extras, e.g. cuda (default: none; the CPU backend needs none)
#   --pip-args ARGS   extra pip arguments, e.g. "--no-index --find-links /srv/wheels" on a
#                     line-side server without internet access
#   --socket          also install and enable scratchd.socket (socket activation)
#   --no-start        install only; do not enable, start or restart anything
#   --root DIR        stage into DIR instead of / (packaging, tests): no user is created,
#                     nothing is chowned and systemctl is not called
#   --keep N          releases kept for rollback (default 3)
#
# What it does, each step safe to repeat:
#   1. the system user and group `scratchd` (home /var/lib/scratchd, no login shell);
#   2. a fresh virtualenv per install under PREFIX/releases/<UTC time>, the package installed
#      into it (not editable: the checkout may go away) and byte-compiled, because the
#      service runs with a read-only /opt;
#   3. PREFIX/venv, a symlink, switched atomically to the new release;
#   4. /etc/scratchd/scratchd.toml written only if absent (an operator's edits are never
#      overwritten); the shipped one goes to scratchd.toml.dist for comparison;
#   5. the unit files into /etc/systemd/system, `systemctl daemon-reload`, enable, and start
#      or — on an upgrade — restart (SIGTERM drains every accepted request first).
#
# Why a release per install: the unit starts PREFIX/venv/bin/scratchd, whose interpreter
# line names the release's own python, so a running daemon (and every worker it re-execs)
# stays on the code it started with after the symlink moves; only the restart switches.
# Rollback: point PREFIX/venv at the previous release and `systemctl restart scratchd`.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
prefix=/opt/scratchd
extras=""
pip_args=""
with_socket=0
start=1
root=""
keep=3
source_spec=""

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "install-systemd: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) prefix="${2:?}"; shift 2 ;;
        --extras) extras="${2:?}"; shift 2 ;;
        --pip-args) pip_args="${2:?}"; shift 2 ;;
        --socket) with_socket=1; shift ;;
        --no-start) start=0; shift ;;
        --root) root="$(realpath -m "${2:?}")"; shift 2 ;;
        --keep) keep="${2:?}"; shift 2 ;;
        -h|--help) usage 0 ;;
        -*) echo "unknown option $1" >&2; usage 2 ;;
        *) source_spec="$1"; shift ;;
    esac
done
[[ "$prefix" == /* ]] || die "--prefix must be absolute, not $prefix"
[[ "$keep" =~ ^[1-9][0-9]*$ ]] || die "--keep must be a positive number"
source_spec="${source_spec:-$here}"
[[ -n "$extras" ]] && source_spec="${source_spec}[${extras}]"
staged=0
[[ -n "$root" ]] && staged=1
[[ $staged == 1 || $EUID == 0 ]] || die "run as root (or stage with --root DIR)"

releases="$root$prefix/releases"
etc="$root/etc/scratchd"
units="$root/etc/systemd/system"

ensure_user() {
    if [[ $staged == 1 ]] || getent passwd scratchd >/dev/null; then return; fi
    useradd --system --user-group --home-dir /var/lib/scratchd --no-create-home \
        --shell /usr/sbin/nologin --comment "scratchd inspection daemon" scratchd
    echo "created system user scratchd"
}

install_release() {
    local stamp release
    stamp="$(date -u +%Y%m%dT%H%M%SZ)"
    release="$releases/$stamp"
    [[ -e "$release" ]] && die "$release already exists (two installs within a second?)"
    mkdir -p "$releases"
    # A failed install must not leave a half-built release behind to be pruned into use.
    trap 'rm -rf "$release"' ERR
    # The venv is created at the path the service runs it from: scripts' interpreter lines
    # are absolute, so a staged (--root) release only runs from inside the staging root.
    python3 -m venv "$release"
    # shellcheck disable=SC2086  # pip_args is a list of words on purpose
    "$release/bin/pip" install --quiet --disable-pip-version-check $pip_args "$source_spec"
    "$release/bin/python" -m compileall -q "$release/lib" >/dev/null
    trap - ERR
    ln -sfn "releases/$stamp" "$root$prefix/venv.new"
    mv -T "$root$prefix/venv.new" "$root$prefix/venv"
    install -m 0644 "$here/README.md" "$root$prefix/README.md"
    echo "installed $("$release/bin/python" -c 'import importlib.metadata as m; print(m.version("scratchd"))') into $release"
}

prune_releases() {
    local current
    current="$(readlink "$root$prefix/venv")"
    # Oldest first by name (UTC stamps sort); never the current one.
    find "$releases" -mindepth 1 -maxdepth 1 -type d -printf '%f\n' | sort |
        head -n -"$keep" | while read -r old; do
        [[ "releases/$old" == "$current" ]] && continue
        rm -rf "${releases:?}/$old"
        echo "removed old release $old"
    done
}

install_config() {
    install -d -m 0750 "$etc"
    install -m 0644 "$here/systemd/scratchd.toml" "$etc/scratchd.toml.dist"
    if [[ ! -e "$etc/scratchd.toml" ]]; then
        install -m 0640 "$here/systemd/scratchd.toml" "$etc/scratchd.toml"
        echo "wrote $etc/scratchd.toml"
    fi
    if [[ $staged == 0 ]]; then
        chown root:scratchd "$etc" "$etc/scratchd.toml"
    fi
}

install_units() {
    install -d -m 0755 "$units"
    local unit
    for unit in scratchd.service scratchd.socket; do
        sed "s#/opt/scratchd#$prefix#g" "$here/systemd/$unit" > "$units/$unit.tmp"
        chmod 0644 "$units/$unit.tmp"
        mv -f "$units/$unit.tmp" "$units/$unit"
    done
}

systemd_running() { [[ $staged == 0 && -d /run/systemd/system ]]; }

activate() {
    if ! systemd_running; then
        echo "systemd is not running here: units installed, nothing started"
        return
    fi
    systemctl daemon-reload
    [[ $start == 1 ]] || return 0
    if [[ $with_socket == 1 ]]; then
        systemctl enable --now scratchd.socket
    fi
    systemctl enable scratchd.service
    if systemctl is-active --quiet scratchd.service; then
        # A code upgrade needs a restart; SIGTERM drains first. (Config or model only:
        # `systemctl reload scratchd` replaces workers one at a time instead.)
        systemctl restart scratchd.service
        echo "restarted scratchd.service on the new release"
    elif [[ $with_socket == 0 ]]; then
        systemctl start scratchd.service
        echo "started scratchd.service"
    fi
}

ensure_user
install_release
prune_releases
install_config
install_units
activate
