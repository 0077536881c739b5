#!/usr/bin/env bash
# Teacher-forced agreement with llama.cpp for the large-MoE families (issue 19), never in CI:
# for each architecture a synthetic file at its tiny real-shape config (`memfit synth --size
# tiny`; random weights and routing), then benchmarks/moe_agreement.py's three steps (memfit,
# llama.cpp batch 512 and batch 1, compare); then the same on an all-F32 file from the test
# writer (models/synthetic.py), where neither side quantizes activations: any difference
# there is a difference in the computation itself. Rows go to benchmarks/arch_agreement.jsonl.
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
  # all F32 (glm-dsa: 56 tokens, under its tiny indexer's top-k of 64: dense in both)
  f="$WORK/$arch-f32.gguf"
  "$MEMFIT_PY" -c "from memfit.models.synthetic import write_tiny_model as w; w('$f', '$arch', 'F32', seed=5, tied=False)"
  n=$N
  [ "$arch" = glm-dsa ] && n=56
  d="$WORK/$arch-f32"
  rm -rf "$d"
  "$MEMFIT_PY" benchmarks/moe_agreement.py memfit "$f" "$d" -n "$n"
  OMP_WAIT_POLICY=passive "$PEER" benchmarks/moe_agreement.py llama "$f" "$d"
  "$MEMFIT_PY" benchmarks/moe_agreement.py compare "$f" "$d" --out benchmarks/arch_agreement.jsonl
done
