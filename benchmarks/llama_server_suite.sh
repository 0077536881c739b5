#!/usr/bin/env bash
# llama.cpp's server test suite (tools/server/tests of the llama-cpp-python 0.3.36 sdist) run
# against `memfit serve` through benchmarks/llama_server_shim.py. Not CI: it downloads the
# sdist (package registry only) and runs a few hundred server starts.
#   benchmarks/llama_server_suite.sh [pytest args, e.g. unit/test_chat_completion.py]
# Env: WORK (scratch dir, default /tmp/llama-suite), MEMFIT_SUITE_MODEL (default smollm2-135m),
# PY (the python with memfit installed, default .venv/bin/python). Writes $WORK/report.xml.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${WORK:-/tmp/llama-suite}"
PY="${PY:-$repo/.venv/bin/python}"
mkdir -p "$WORK"
if [ ! -d "$WORK/llama_cpp_python-0.3.36" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$WORK" -q
  tar xzf "$WORK/llama_cpp_python-0.3.36.tar.gz" -C "$WORK" \
    --wildcards '*/vendor/llama.cpp/tools/server/tests/*' '*/vendor/llama.cpp/models/templates/*'
fi
T="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/tests"
"$PY" -m pip install -q pytest aiohttp filelock requests wget openai prometheus-client 2>/dev/null
shim="$WORK/llama-server"
printf '#!/usr/bin/env bash\nexec "%s" "%s" "$@"\n' "$PY" "$repo/benchmarks/llama_server_shim.py" > "$shim"
chmod +x "$shim"
cd "$T"
export LLAMA_SERVER_BIN_PATH="$shim"
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(unit/test_chat_completion.py unit/test_completion.py
  unit/test_tool_call.py unit/test_compat_anthropic.py unit/test_compat_oai_responses.py
  unit/test_security.py)
"$PY" -m pytest -q -p no:cacheprovider --junitxml="$WORK/report.xml" -o addopts="" \
  "${targets[@]}" || true
