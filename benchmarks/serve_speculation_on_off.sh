#!/usr/bin/env bash
# The README's serving benchmark: two servers on the default model, one speculating with n-grams
# and one not, measured side by side by `specserve bench serve` (they take turns on every load
# level, so the host's noise hits both alike). Extra arguments go to `bench serve`.
#
#   benchmarks/serve_speculation_on_off.sh OUTPUT.json [--concurrency 1,4,16 ...]
set -euo pipefail
output=${1:?usage: $0 OUTPUT.json [bench serve arguments]}
shift
bin=${BIN:-.venv/bin}
# On a GPU the two servers share the card (0.9 each would refuse the second); ignored on CPU.
share=(--gpu-memory-utilization "${GPU_SHARE:-0.45}")
"$bin/specserve" serve --port 8001 --log-level warning "${share[@]}" &
ngram=$!
"$bin/specserve" serve --port 8002 --speculative-method none --log-level warning "${share[@]}" &
none=$!
trap 'kill $ngram $none 2>/dev/null; wait' EXIT
"$bin/python" - <<'PY'
import time, httpx
for port in (8001, 8002):
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
"$bin/specserve" bench serve --base-url http://127.0.0.1:8001 --base-url http://127.0.0.1:8002 \
    --label ngram --label none --output "$output" "$@"
