#!/usr/bin/env bash
# The engine core in the server's thread against the engine core in its own process (issue 70,
# `--engine-core`): two servers on the default model, measured side by side by `specserve bench
# serve` (they take turns on every load level, so the host's noise hits both alike). The figures
# behind `--engine-core auto`'s choice per device. Extra arguments go to `bench serve`.
#
#   flock /tmp/specserve-bench.lock benchmarks/engine_core_modes.sh OUTPUT.json \
#       [--concurrency 1,16 ...]
set -euo pipefail
output=${1:?usage: $0 OUTPUT.json [bench serve arguments]}
shift
bin=${BIN:-.venv/bin}
# On a GPU the two servers share the card (0.9 each would refuse the second); ignored on CPU.
share=(--gpu-memory-utilization "${GPU_SHARE:-0.45}")
"$bin/python" -m server serve --port 8011 --engine-core thread --log-level warning "${share[@]}" &
thread=$!
"$bin/python" -m server serve --port 8012 --engine-core process --log-level warning "${share[@]}" &
process=$!
trap 'kill $thread $process 2>/dev/null; wait' EXIT
"$bin/python" - <<'PY'
import time, httpx
for port in (8011, 8012):
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    else:
        raise SystemExit(f"server on port {port} did not become healthy")
PY
# PROCESS_FIRST=1: the process server takes the first turn at each level (a second run, so the
# order of turns is not what the figures show).
urls=(--base-url http://127.0.0.1:8011 --label thread --base-url http://127.0.0.1:8012 --label process)
if [[ "${PROCESS_FIRST:-0}" == 1 ]]; then
    urls=(--base-url http://127.0.0.1:8012 --label process --base-url http://127.0.0.1:8011 --label thread)
fi
"$bin/python" -m specserve bench serve "${urls[@]}" --output "$output" "$@"
