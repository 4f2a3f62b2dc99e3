#!/usr/bin/env bash
# Installs promtool into .tools/bin/promtool (for `promtool test rules` on the chart's alert rules)
# without installing Prometheus as a service: downloads Debian's `prometheus` package with apt,
# unpacks it into a temporary directory and keeps only usr/bin/promtool. Needs apt (Debian
# bookworm ships 2.42.0); skips everything when a working promtool is already there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.tools/bin"
if [ -x "$dest/promtool" ] && "$dest/promtool" --version >/dev/null 2>&1; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
# apt-get download as root warns that its sandbox user cannot write here; harmless.
if ! apt-get download -qq prometheus >/dev/null 2>"$tmp/err"; then
    # No package lists yet (a fresh image): refresh them when we may, and try once more.
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        apt-get download -qq prometheus >/dev/null 2>"$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
    else
        cat "$tmp/err" >&2
        echo "fetch_promtool: apt-get download prometheus failed (run apt-get update as root?)" >&2
        exit 1
    fi
fi
dpkg-deb -x prometheus_*.deb "$tmp/x"
mkdir -p "$dest"
install -m 0755 "$tmp/x/usr/bin/promtool" "$dest/promtool"
"$dest/promtool" --version | head -1
