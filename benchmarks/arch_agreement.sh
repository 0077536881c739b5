#!/usr/bin/env bash
# Teacher-forced agreement with llama.cpp for the large-MoE families (issue 19), never in CI:
# for each architecture a synthetic file at its tiny real-shape config (`memfit synth --size
# tiny`; random weights and routing), then benchmarks/moe_agreement.py's three steps (memfit,
# llama.cpp batch 512 and batch 1, compare). Rows go to benchmarks/arch_agreement.jsonl.
#   PEER=/root/peer-venv/bin/python bash benchmarks/arch_agreement.sh [ARCH...]
set -euo pipefail
cd "$(dirname "$0")/.."
PEER=${PEER:-/root/peer-venv/bin/python}
MEMFIT_PY=${MEMFIT_PY:-.venv/bin/python}
WORK=${WORK:-/tmp/arch_agreement}
N=${N:-256}
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(glm4moe deepseek2 glm-dsa gpt-oss)
mkdir -p "$WORK"
for arch in "${archs[@]}"; do
  quant=Q4_K_M
  [ "$arch" = gpt-oss ] && quant=MXFP4_MOE
  f="$WORK/$arch-tiny-$quant.gguf"
  [ -f "$f" ] || "$MEMFIT_PY" -m memfit synth "$f" --arch "$arch" --size tiny --quant "$quant" --json
  d="$WORK/$arch"
  rm -rf "$d"
  "$MEMFIT_PY" benchmarks/moe_agreement.py memfit "$f" "$d" -n "$N"
  OMP_WAIT_POLICY=passive "$PEER" benchmarks/moe_agreement.py llama "$f" "$d"
  "$MEMFIT_PY" benchmarks/moe_agreement.py compare "$f" "$d" --out benchmarks/arch_agreement.jsonl
done
