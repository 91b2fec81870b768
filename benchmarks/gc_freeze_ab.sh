#!/usr/bin/env bash
# The server with and without its start-up objects frozen out of the garbage collector
# (server/loop_lag.py, SPECSERVE_GC_FREEZE), taking turns (off, on, off, on): each turn a fresh
# `specserve serve` (default model, ngram) under `specserve bench serve --workload mixed`
# (8 concurrent, 10% hang-ups, one hostile body a second) for --duration seconds. Writes one JSON
# holding each turn's report; what it compares is each report's server_state.after_idle:
# loop_lags_over_50ms (event-loop wake-ups more than 50 ms late) and loop_lag_max_le_s.
#   benchmarks/gc_freeze_ab.sh [--duration 120] [--output benchmarks/results/gc_freeze_ab.json]
set -euo pipefail
cd "$(dirname "$0")/.."
duration=120
output=benchmarks/results/gc_freeze_ab_cpu_$(date +%F).json
while (($#)); do
    case $1 in
        --duration) duration=$2; shift 2 ;;
        --output) output=$2; shift 2 ;;
        *) echo "$0: unknown argument $1" >&2; exit 2 ;;
    esac
done
bin=${BIN:-.venv/bin}
work=$(mktemp -d /tmp/gc_freeze_ab.XXXXXX)
port=$("$bin/python" -m benchmarks.vs_llamacpp ports 1)
turn=0
for freeze in 0 1 0 1; do
    turn=$((turn + 1))
    SPECSERVE_GC_FREEZE=$freeze "$bin/specserve" serve --port "$port" \
        --speculative-method ngram --log-level warning >"$work/server_$turn.log" 2>&1 &
    server=$!
    "$bin/python" -m benchmarks.vs_llamacpp wait "http://127.0.0.1:$port/health" "$server"
    "$bin/specserve" bench serve --base-url "http://127.0.0.1:$port" --label "freeze-$freeze" \
        --workload mixed --max-tokens 128 --concurrency 8 --duration "$duration" \
        --disconnect-fraction 0.1 --hostile-rate 1 --no-progress --seed "$turn" \
        --output "$work/turn_${turn}_freeze_$freeze.json" >/dev/null
    kill -TERM "$server"
    wait "$server" || true
done
"$bin/python" - "$output" "$work"/turn_*.json <<'PY'
import json, sys
turns = [json.load(open(path)) for path in sys.argv[2:]]
summary = []
for report in turns:
    run = report["runs"][0]
    result = run["results"][0]
    after = result["server_state"]["after_idle"]
    summary.append({"label": run["label"], "completed": result["completed"],
                    "failed": result["failed"],
                    "output_throughput": result["output_throughput"],
                    "loop_lags_over_50ms": after.get("loop_lags_over_50ms"),
                    "loop_lag_max_le_s": after.get("loop_lag_max_le_s")})
json.dump({"benchmark": "gc_freeze_ab", "summary": summary, "turns": turns},
          open(sys.argv[1], "w"), indent=2)
print(json.dumps(summary, indent=2))
PY
