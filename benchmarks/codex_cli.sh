#!/usr/bin/env bash
# Codex CLI (npm @openai/codex) against a running specserve over the Responses API: one
# non-interactive `codex exec` turn, its own CODEX_HOME (nothing of ~/.codex is read or written).
#   benchmarks/codex_cli.sh [BASE_URL] [MODEL]
# Needs node/npm; installs @openai/codex into a temporary folder. Prints Codex's output and exit
# status; what the server refused (a 400 naming the parameter) is in Codex's error line.
set -euo pipefail
BASE_URL=${1:-http://127.0.0.1:8000/v1}
MODEL=${2:-SmolLM2-135M-Instruct}
WORK=${CODEX_WORK:-$(mktemp -d)}
if [ ! -x "$WORK/node_modules/.bin/codex" ]; then
  (cd "$WORK" && npm install --no-audit --no-fund @openai/codex >/dev/null)
fi
mkdir -p "$WORK/home"
export CODEX_HOME="$WORK/home" SPECSERVE_KEY=${SPECSERVE_API_KEY:-unused}
start=$(date +%s.%N)
set +e
timeout 300 "$WORK/node_modules/.bin/codex" exec --skip-git-repo-check \
  -c model_provider=specserve -c model="$MODEL" \
  -c model_providers.specserve.name=specserve \
  -c model_providers.specserve.base_url="$BASE_URL" \
  -c model_providers.specserve.wire_api=responses \
  -c model_providers.specserve.env_key=SPECSERVE_KEY \
  "Say hello in one short sentence."
status=$?
set -e
echo "codex exit status: $status, $(echo "$(date +%s.%N) - $start" | bc) s"
