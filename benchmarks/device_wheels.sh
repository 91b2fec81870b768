#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (its image has torch, transformers, triton, httpx,
# prometheus-client, numpy...; the device tool's KINDS.md lists them), at the versions this
# machine's venv runs, for Python 3.12 on x86-64, into .whl (git-ignored through
# .git/info/exclude): `device_check.sh setup` or `wheels` installs them there.
#
#   benchmarks/device_wheels.sh        # then carry .whl
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-.venv/bin}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
# fastapi's telemetry imports opentelemetry's API at import time
names=(gguf fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection
       llguidance jsonschema jsonschema-specifications referencing rpds-py openai jiter sniffio
       distro anyio typing_extensions opentelemetry-api)
pins=()
for name in "${names[@]}"; do
    version=$("$bin/python" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    pins+=("$name${version:+==$version}")
done
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 "${platforms[@]}" -d .whl "${pins[@]}"
du -sh .whl
