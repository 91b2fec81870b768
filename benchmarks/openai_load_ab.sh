#!/usr/bin/env bash
# Methods through the server, one fresh server at a time taking turns, measured by the shared
# closed-loop client (../shared/bench/openai_load.py: its 6 code/copy/chat prompts, greedy,
# max_tokens 128) at one concurrency. Each server starts fresh, so each run includes its own
# start-up cost probe (engine/spec_decode/cost_probe.py). Prints one JSON object.
#
#   benchmarks/openai_load_ab.sh OUTPUT.json [ROUNDS] [CONCURRENCY] [METHODS...]
#   e.g. benchmarks/openai_load_ab.sh /tmp/ab.json 4 16 ngram none ngram
set -euo pipefail
output=${1:?usage: $0 OUTPUT.json [ROUNDS] [CONCURRENCY] [METHODS...]}
rounds=${2:-3}; concurrency=${3:-16}; shift $(( $# < 3 ? $# : 3 ))
methods=("$@"); [ ${#methods[@]} -gt 0 ] || methods=(ngram none)
bin=${BIN:-.venv/bin}; port=${PORT:-8311}
client=${CLIENT:-../shared/bench/openai_load.py}
work=$(mktemp -d)
for round in $(seq "$rounds"); do
    for i in "${!methods[@]}"; do
        method=${methods[$i]}; tag="${round}_${i}_${method}"
        "$bin/specserve" serve --port "$port" --speculative-method "$method" \
            >"$work/server_$tag.log" 2>&1 &
        pid=$!
        for _ in $(seq 300); do curl -sf "localhost:$port/ready" >/dev/null && break; sleep 1; done
        "$bin/python" "$client" --base-url "http://127.0.0.1:$port" \
            --model SmolLM2-135M-Instruct --concurrency "$concurrency" --max-tokens 128 \
            --num-requests $((3 * concurrency)) --warmup 2 >"$work/$tag.json"
        kill "$pid"; wait "$pid" || true
    done
done
"$bin/python" - "$work" "$output" "$concurrency" <<'PY'
import json, re, statistics, sys
from pathlib import Path
from benchmarks.machine import cpu_model, our_versions
work, output, concurrency = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
runs = []
for path in sorted(work.glob("*.json"), key=lambda p: [int(x) for x in p.stem.split("_")[:2]]):
    round_, _, method = path.stem.split("_", 2)
    log = (work / f"server_{path.stem}.log").read_text()
    probe = re.search(r"step cost: ([\d.]+) ms \+ ([\d.]+) ms per row unit", log)
    runs.append({"round": int(round_), "method": method,
                 "throughput_tok_s": json.loads(path.read_text())["throughput_tok_s"],
                 "startup_probe_ms": None if probe is None else
                 {"fixed": float(probe[1]), "per_row_unit": float(probe[2])}})
by_method = {}
for run in runs:
    by_method.setdefault(run["method"], []).append(run["throughput_tok_s"])
none = statistics.median(by_method["none"]) if "none" in by_method else None
summary = {m: {"median_tok_s": statistics.median(v), "min": min(v), "max": max(v), "runs": len(v),
               "median_vs_none_median": None if not none else round(statistics.median(v) / none, 3)}
           for m, v in by_method.items()}
result = {"benchmark": "openai_load_ab", "cpu": cpu_model(), "concurrency": concurrency,
          "client": "shared/bench/openai_load.py, 6 prompts, greedy, max_tokens 128",
          "versions": our_versions(), "summary": summary, "runs": runs}
Path(output).write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(summary))
PY
