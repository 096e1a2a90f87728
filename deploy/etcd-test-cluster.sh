#!/usr/bin/env bash
# Start a local N-member etcd v3 cluster on 127.0.0.1 for trying rdzv-server's replicas by hand.
#
#   deploy/etcd-test-cluster.sh [N=3] [FIRST_CLIENT_PORT=23790] [FIRST_PEER_PORT=23890]
#
# Member i (0-based) serves clients on FIRST_CLIENT_PORT+i and peers on FIRST_PEER_PORT+i;
# data dirs and logs go in a fresh temp folder, which is printed and deleted on exit.
# It prints the client URLs (the value for --etcd), waits until every member reports
# healthy, then stays in the foreground: Ctrl-C (or SIGTERM) stops every member and
# removes the folder. Loopback only: never a cluster to keep data in.
# The Python tests use tests/etcd_cluster.py instead (free ports chosen at run time).
# Needs the etcd binary: apt-get install etcd-server (Debian/Ubuntu).
set -euo pipefail

n=${1:-3}
client_port=${2:-23790}
peer_port=${3:-23890}

if ! command -v etcd >/dev/null 2>&1; then
  echo "etcd not installed: apt-get install etcd-server" >&2
  exit 1
fi
case $n in
  '' | *[!0-9]* | 0) echo "N must be a positive integer, not '$n'" >&2; exit 2 ;;
esac

dir=$(mktemp -d "${TMPDIR:-/tmp}/rdzv-etcd.XXXXXX")
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 0' INT TERM

cluster=""
clients=""
for ((i = 0; i < n; i++)); do
  cluster+="${cluster:+,}m$i=http://127.0.0.1:$((peer_port + i))"
  clients+="${clients:+,}http://127.0.0.1:$((client_port + i))"
done
token="rdzv-test-$$-$RANDOM"

for ((i = 0; i < n; i++)); do
  etcd --name "m$i" --data-dir "$dir/m$i" \
    --listen-client-urls "http://127.0.0.1:$((client_port + i))" \
    --advertise-client-urls "http://127.0.0.1:$((client_port + i))" \
    --listen-peer-urls "http://127.0.0.1:$((peer_port + i))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((peer_port + i))" \
    --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token "$token" \
    >"$dir/m$i.log" 2>&1 &
  pids+=("$!")
done

# Bounded wait: 30 s for every member to answer /health with a leader elected.
for ((i = 0; i < n; i++)); do
  url="http://127.0.0.1:$((client_port + i))/health"
  for ((try = 0; ; try++)); do
    if curl -fsS --max-time 1 "$url" 2>/dev/null | grep -q '"health":"true"'; then break; fi
    if ((try >= 150)); then
      echo "member m$i did not become healthy in 30 s; its log: $dir/m$i.log" >&2
      tail -n 20 "$dir/m$i.log" >&2 || true
      exit 1
    fi
    sleep 0.2
  done
done

echo "etcd cluster of $n members is healthy; data and logs in $dir"
echo "--etcd $clients"
wait
