#!/usr/bin/env bash
# Build tools/vd_harness.c against csrc/ (the kernels without the Python bindings; memfit.h
# includes Python.h, so it links the embeddable libpython) into $TMPDIR and run it.
# Usage: tools/vd-harness.sh [TYPE [ROWS [PF_DIST [BLOCKS_PER_ROW]]]]   (SRC=other/csrc: another tree;
# VD4=1: the AVX2 4-row kernel, its rows checked bit for bit against the 1-row kernel first)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
src=${SRC:-$here/../csrc}
out=${TMPDIR:-/tmp}/memfit-vd-harness-$$
inc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
gcc -O3 -std=c11 -I"$src" -I"$inc" -o "$out" "$here/vd_harness.c" "$src"/quant_avx2.c \
    "$src"/quant_tables.c "$src"/quant_iq2.c "$src"/quant_iq3.c "$src"/quant_fp4tq.c \
    "$src"/quant.c "$src"/quant_avx512.c "$src"/pool.c "$src"/quant_mm.c -lm -lpthread \
    $(python3-config --ldflags --embed)
trap 'rm -f "$out"' EXIT
"$out" "$@"
