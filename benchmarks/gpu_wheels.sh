#!/usr/bin/env bash
# Wheels the GPU host lacks (it has torch, triton, transformers, safetensors, xxhash, uvloop, httpx, aiohttp),
# downloaded here into .whl/ (ignored by git) and carried with `run(..., carry=[".whl"])`.
# On the GPU host:  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn h11 click \
  opentelemetry-api prometheus_client openai distro jiter sniffio anyio annotated-doc pytest pluggy iniconfig tqdm \
  xgrammar apache-tvm-ffi
ls .whl
