#!/usr/bin/env bash
# A whole swarm on this machine: a bootstrap node, N training peers and the monitor, all on 127.0.0.1.
#
# Usage (from a fresh clone, after `pip install -e .`):
#   scripts/local_swarm.sh                       # 3 peers, configs/tiny.yaml, monitor page on http://127.0.0.1:8080/
#   scripts/local_swarm.sh --peers 4 --port 8081 -- --set train.rounds=20
#
# Options:
#   --peers N        training peers (default 3); peer K trains shard K (data.shard_index=K)
#   --port P         the monitor's HTTP port (default 8080)
#   --config FILE    run_peer preset (default configs/tiny.yaml)
#   --run-dir DIR    where everything is written (default runs/local_swarm); this script's previous output
#                    there (peerK/, monitor/, bootstrap.log) is replaced
#   --interval S     monitor refresh seconds (default 2)
#   --samples        the monitor also shows samples of the state the swarm vouches for (run_monitor --samples,
#                    every 30 s; it gets the peers' --config and --set)
#   -- ARGS...       passed as-is to every run_peer (e.g. --set swarm.record_ttl=30)
#
# Writes: DIR/bootstrap.log, DIR/peerK/{stdout.log,metrics.jsonl,run_metadata.json,checkpoints/},
#         DIR/monitor/{monitor.jsonl,stderr.log}, and at the end DIR/monitor/plots/*.png.
# The monitor's table is shown here. When every peer has finished (train.rounds), or on Ctrl-C, the
# script stops what it started (SIGTERM to each PID it started, SIGKILL to what is left after 30 s).
# Environment: PYTHON (default: python, else python3).
set -euo pipefail

PEERS=3
PORT=8080
CONFIG=configs/tiny.yaml
RUN_DIR=runs/local_swarm
INTERVAL=2
SAMPLES=0
PEER_ARGS=()
usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --peers) PEERS="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    --interval) INTERVAL="$2"; shift 2 ;;
    --samples) SAMPLES=1; shift ;;
    --) shift; PEER_ARGS=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "local_swarm.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
done
[[ "$PEERS" =~ ^[1-9][0-9]*$ ]] || { echo "local_swarm.sh: --peers must be a positive integer, got $PEERS" >&2; exit 2; }

cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python || command -v python3)}"
SETSID=$(command -v setsid || true)  # own session per child: the terminal's Ctrl-C reaches only this script
LOCAL=(--host-maddrs /ip4/127.0.0.1/tcp/0)

# the run id (the monitor needs it) and shard count, from the config and any --set among the peer args;
# this also checks the config before anything starts
SETS=()
for ((i = 0; i < ${#PEER_ARGS[@]}; i++)); do
  [[ "${PEER_ARGS[$i]}" == "--set" && $((i + 1)) -lt ${#PEER_ARGS[@]} ]] && SETS+=("${PEER_ARGS[$((i + 1))]}")
done
read -r RUN_ID NUM_SHARDS < <("$PY" -c '
import sys
from p2p_diloco.config import ConfigError, load_config
try:
    cfg = load_config(sys.argv[1], sys.argv[2:])
except ConfigError as exc:
    sys.exit(f"local_swarm.sh: {exc}")
print(cfg.swarm.run_id, cfg.data.num_shards)' "$CONFIG" ${SETS[@]+"${SETS[@]}"}) || exit 2
SHARDS=()
((PEERS > NUM_SHARDS)) && SHARDS=(--set "data.num_shards=$PEERS")

mkdir -p "$RUN_DIR"
rm -rf "$RUN_DIR"/peer[0-9]* "$RUN_DIR/monitor" "$RUN_DIR/bootstrap.log"
PIDS=()
start() {  # start LOG CMD...: in the background, in its own session, stdout+stderr to LOG ("-": this terminal)
  local log="$1"; shift
  if [[ "$log" == "-" ]]; then $SETSID "$@" & else $SETSID "$@" >"$log" 2>&1 & fi
  PIDS+=("$!")
}
STOPPED=0
stop_all() {
  ((STOPPED)) && return; STOPPED=1
  trap '' INT TERM
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 60); do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.5
  done
  for pid in "${PIDS[@]}"; do  # the process group too (a peer's DHT child and p2pd) when it had its own session
    if kill -0 "$pid" 2>/dev/null; then
      echo "local_swarm.sh: $pid did not stop within 30 s; killing it" >&2
      [[ -n "$SETSID" ]] && kill -KILL -- "-$pid" 2>/dev/null; kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  wait 2>/dev/null || true
}
trap 'echo; echo "local_swarm.sh: stopping"; stop_all; exit 130' INT TERM
trap 'stop_all' EXIT

echo "local_swarm.sh: run '$RUN_ID', $PEERS peers, config $CONFIG, logs in $RUN_DIR/"
start "$RUN_DIR/bootstrap.log" "$PY" -m peers.run_bootstrap "${LOCAL[@]}"
BOOT_PID=${PIDS[0]}
INITIAL=""
for _ in $(seq 240); do
  INITIAL=$(grep -m1 '^--initial-peers ' "$RUN_DIR/bootstrap.log" 2>/dev/null | cut -d' ' -f2- || true)
  [[ -n "$INITIAL" ]] && break
  kill -0 "$BOOT_PID" 2>/dev/null || break
  sleep 0.5
done
if [[ -z "$INITIAL" ]]; then
  echo "local_swarm.sh: the bootstrap node did not start; its log ($RUN_DIR/bootstrap.log):" >&2
  cat "$RUN_DIR/bootstrap.log" >&2
  exit 1
fi
read -r -a INITIAL_PEERS <<<"$INITIAL"

mkdir -p "$RUN_DIR/monitor"
PEER_DIRS=()
for ((k = 0; k < PEERS; k++)); do PEER_DIRS+=("$RUN_DIR/peer$k"); done
URL="http://127.0.0.1:$PORT/"
cat <<EOF
local_swarm.sh: monitor page   $URL   (JSON: ${URL}status, Prometheus: ${URL}metrics)
local_swarm.sh: peers' logs    $RUN_DIR/peer{0..$((PEERS - 1))}/stdout.log and metrics.jsonl
local_swarm.sh: monitor        $RUN_DIR/monitor/monitor.jsonl (warnings: $RUN_DIR/monitor/stderr.log)
local_swarm.sh: Ctrl-C stops everything
EOF
MONITOR_SAMPLES=()
if ((SAMPLES)); then  # the settings the peers' fingerprint is made of: their config and --set overrides
  MONITOR_SAMPLES=(--samples --sample-every 30 --config "$CONFIG" ${SHARDS[@]+"${SHARDS[@]}"})
  for s in ${SETS[@]+"${SETS[@]}"}; do MONITOR_SAMPLES+=(--set "$s"); done
fi
start - "$PY" -m peers.run_monitor --initial-peers "${INITIAL_PEERS[@]}" --run-id "$RUN_ID" --out "$RUN_DIR/monitor" \
  --port "$PORT" --interval "$INTERVAL" "${LOCAL[@]}" --peer-logs "${PEER_DIRS[@]}" \
  ${MONITOR_SAMPLES[@]+"${MONITOR_SAMPLES[@]}"} 2>"$RUN_DIR/monitor/stderr.log"
MONITOR_PID=${PIDS[1]}
until "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$URL" 2>/dev/null; do
  if ! kill -0 "$MONITOR_PID" 2>/dev/null; then
    echo "local_swarm.sh: the monitor did not start:" >&2
    cat "$RUN_DIR/monitor/stderr.log" >&2
    exit 1
  fi
  sleep 0.5
done

# Several peers share this machine: one OpenMP thread each (oversubscribed OpenMP threads spin-wait).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
PEER_PIDS=()
for ((k = 0; k < PEERS; k++)); do
  mkdir -p "$RUN_DIR/peer$k"
  start "$RUN_DIR/peer$k/stdout.log" "$PY" -m peers.run_peer --config "$CONFIG" --log-dir "$RUN_DIR/peer$k" \
    "${LOCAL[@]}" --initial-peers "${INITIAL_PEERS[@]}" --set "data.shard_index=$k" ${SHARDS[@]+"${SHARDS[@]}"} \
    --set "swarm.start_peers=$PEERS" ${PEER_ARGS[@]+"${PEER_ARGS[@]}"}
  PEER_PIDS+=("${PIDS[-1]}")
done

status=0
for pid in "${PEER_PIDS[@]}"; do wait "$pid" || status=$?; done
echo "local_swarm.sh: all peers finished (exit status $status); writing plots"
"$PY" -m peers.run_monitor --plot "$RUN_DIR/monitor" --peer-logs "${PEER_DIRS[@]}" || true
stop_all
exit "$status"
