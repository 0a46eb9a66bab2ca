#!/usr/bin/env bash
# Two Colibri replicas on loopback behind nginx (least_conn), started in order: the replicas,
# each waited for until its /health answers 200, then nginx. SIGTERM or Ctrl-C stops all three.
#
#   examples/nginx/start.sh MODEL_DIR [LISTEN_PORT] [REPLICA_PORT_1] [REPLICA_PORT_2]
#
# Defaults: nginx on 8080, replicas on 8001 and 8002; THREADS (default 1) threads per replica
# (give each replica its own cores: taskset or cgroups); WORKDIR (default a new temporary
# directory) holds the nginx configuration, its pid and logs, and each replica's log.
# Needs nginx (Debian: apt-get install nginx-light) and colibri-moe[serve].
set -euo pipefail

MODEL_DIR=${1:?usage: start.sh MODEL_DIR [LISTEN_PORT] [REPLICA_PORT_1] [REPLICA_PORT_2]}
LISTEN=${2:-8080}
PORT1=${3:-8001}
PORT2=${4:-8002}
THREADS=${THREADS:-1}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
WORKDIR=${WORKDIR:-$(mktemp -d -t colibri-nginx.XXXXXX)}
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$NGINX" ] || { echo "error: nginx is not installed (Debian: apt-get install nginx-light)" >&2; exit 2; }
mkdir -p "$WORKDIR"
chmod 755 "$WORKDIR"

ports=("$PORT1" "$PORT2")
pids=()
stop() {
    [ -f "$WORKDIR/nginx.pid" ] && "$NGINX" -p "$WORKDIR" -c "$WORKDIR/nginx.conf" -e "$WORKDIR/error.log" -s quit 2>/dev/null || true
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap 'stop; exit 0' TERM INT
trap 'stop' EXIT

for port in "${ports[@]}"; do
    "$PYTHON" -m colibri serve --model-dir "$MODEL_DIR" --port "$port" --threads "$THREADS" \
        > "$WORKDIR/replica-$port.log" 2>&1 &
    pids+=($!)
done

# /health answers 503 while a replica loads and 200 when it is ready
for i in 0 1; do
    port=${ports[$i]}
    if ! "$PYTHON" - "$port" "${pids[$i]}" <<'PY'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.time() + 300
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)                      # the replica exited: its log says why
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.2)
sys.exit(1)
PY
    then
        echo "error: the replica on port $port did not become healthy; its log ($WORKDIR/replica-$port.log):" >&2
        tail -n 5 "$WORKDIR/replica-$port.log" >&2
        exit 1
    fi
done

sed -e "s|@WORKDIR@|$WORKDIR|g" -e "s|@LISTEN@|$LISTEN|g" -e "s|@PORT1@|$PORT1|g" -e "s|@PORT2@|$PORT2|g" \
    "$HERE/nginx.conf.template" > "$WORKDIR/nginx.conf"
"$NGINX" -p "$WORKDIR" -c "$WORKDIR/nginx.conf" -e "$WORKDIR/error.log"
echo "[INFO] nginx on http://127.0.0.1:$LISTEN -> replicas on $PORT1 and $PORT2 (logs in $WORKDIR)" >&2

# stay in the foreground while the replicas run; if one exits, stop everything
wait -n "${pids[@]}"
echo "error: a replica exited; see $WORKDIR/replica-*.log" >&2
exit 1
