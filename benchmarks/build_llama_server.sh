#!/bin/sh
# Build llama-server from the llama.cpp sources inside the llama-cpp-python sdist (the same
# llama.cpp the peer venv runs). Never in CI. Prints the binary's path.
#   benchmarks/build_llama_server.sh [VERSION]      (JOBS=2, OUT=/tmp/llama-server-build)
set -eu
VER=${1:-0.3.36}
OUT=${OUT:-/tmp/llama-server-build}
PIP=${PIP:-/root/peer-venv/bin/pip}
mkdir -p "$OUT" && cd "$OUT"
[ -f "llama_cpp_python-$VER.tar.gz" ] || "$PIP" download -q --no-deps --no-binary :all: "llama-cpp-python==$VER"
[ -d "llama_cpp_python-$VER" ] || tar xzf "llama_cpp_python-$VER.tar.gz"
cd "llama_cpp_python-$VER/vendor/llama.cpp"
# GCC 12.2 miscompiles llama.cpp's AMX code: on a CPU with AMX build without it
NOAMX=""
grep -qw amx_tile /proc/cpuinfo && NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON \
    -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >/dev/null
cmake --build build --target llama-server -j "${JOBS:-2}" >/dev/null
echo "$PWD/build/bin/llama-server"
