# The bundled Mosquitto's certificate reloader (mqtt.tls.reloader), a sidecar in the broker's pod
# (shareProcessNamespace). Mosquitto reads its certificate at start, and again on SIGHUP. When
# cert-manager renews the Secret, the kubelet swaps a new `..data` folder in under the same file
# names, so their mtimes say nothing: every RELOAD_INTERVAL_S seconds this hashes the contents of
# RELOAD_FILES and, when they changed, sends SIGHUP to the processes named RELOAD_PROCESS.
# POSIX sh with busybox's tools (the eclipse-mosquitto image is Alpine). No trap on TERM: the
# shell, not PID 1 in a shared process namespace, dies at once when the pod stops.
# templates/mosquitto.yaml renders it; tests/helm/test_chart_broker_reload.py runs it.
set -u
files="$RELOAD_FILES"
name="${RELOAD_PROCESS:-mosquitto}"
interval="${RELOAD_INTERVAL_S:-60}"

digest() {  # the files' hashes; fails while one cannot be read
  for f in $files; do
    sum=$(sha256sum < "$f") || return 1
    printf '%s ' "$sum"
  done
}

pids() {  # the processes named $name, by their /proc/PID/comm
  for comm in /proc/[0-9]*/comm; do
    { read -r c < "$comm"; } 2>/dev/null || continue
    [ "$c" = "$name" ] || continue
    pid=${comm#/proc/}
    printf '%s ' "${pid%/comm}"
  done
}

last=$(digest) || last=""
echo "cert-reloader: watching $files every ${interval}s for $name"
while :; do
  sleep "$interval"
  now=$(digest) || { echo "cert-reloader: cannot read $files yet" >&2; continue; }
  [ "$now" = "$last" ] && continue
  # Read again: a read that straddled the kubelet's swap mixes old and new files. Once settled.
  [ "$(digest)" = "$now" ] || continue
  targets=$(pids)
  if [ -z "$targets" ]; then
    echo "cert-reloader: the files changed, but no $name process runs; trying again" >&2
    continue
  fi
  # shellcheck disable=SC2086  # one argument per pid
  if kill -HUP $targets; then
    echo "cert-reloader: the files changed: sent SIGHUP to $name (pid ${targets% })"
    last=$now
  fi
done
