#!/usr/bin/env bash
# Build the native kernels with ASan/UBSan into a scratch dir and run the kernel tests
# against that build (not part of CI's default run: it takes ~1 min on 2 cores).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cp -r "$repo/setup.py" "$repo/csrc" "$repo/pyproject.toml" "$repo/README.md" "$tmp/"
cd "$tmp"
MEMFIT_SANITIZE=1 python setup.py -q build_ext --build-lib out --build-temp obj
mkdir pkg && cp -r "$repo/src/memfit" pkg/ && rm -f pkg/memfit/_native*.so && cp out/memfit/_native*.so pkg/memfit/
cd "$repo"
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
PYTHONPATH="$tmp/pkg" python -m pytest -q -s -p no:cacheprovider \
    tests/test_native_quant.py tests/test_native_pool.py tests/test_native_ops.py \
    tests/test_native_multi.py tests/test_decode_fused.py tests/test_moe_native.py tests/test_moe_stream_fused.py \
    tests/test_kv_quant.py tests/test_quant_fp4tq.py tests/test_quant_iq2.py tests/test_quant_iq3.py \
    -m "not realmodel"
