#!/bin/sh
# The issue 11/12 paired benchmarks in one go, for a quiet machine (never in CI). Each stage
# alternates memfit and its peer (A B A B ...) and appends JSON lines, tagged with the memfit
# commit, the time and the stage, to benchmarks/*.jsonl; the tables go to stdout.
#   benchmarks/quiet_suite.sh [STAGES]     stages: serve pp7b tg7b kernels small interleaved profile budget serve7b
# Needs: the peer venv (/root/peer-venv, llama-cpp-python), llama-server (build_llama_server.sh),
# the built-in models (memfit pull) and the 7B file (memfit synth F7B --arch qwen2 --size 7b).
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
F7B=${F7B:-/work/data/qwen2-7b.gguf}
MODELS=${MODELS:-$HOME/.cache/memfit/models}
SMOL=$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf
GEMMA=$MODELS/gemma-3-270m-q4_k_m.gguf
ROUNDS=${ROUNDS:-3}
STAGES=${1:-serve pp7b tg7b kernels small profile budget}
COMMIT=$(git -C "$HERE" rev-parse --short HEAD)
tag() {  # STAGE: add commit, time and stage to every JSON line of stdin
    sed "s/}\$/, \"memfit_commit\": \"$COMMIT\", \"stage\": \"$1\", \"time\": \"$(date -u +%FT%TZ)\"}/"
}
json() { grep '^{' || true; }
show() { while IFS= read -r l; do printf '%s\n' "$l"; printf '%s\n' "$l" >&2; done; }  # tee to stderr
for s in $STAGES; do
    echo "== $s  $(date -u +%T)  load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
    case $s in
    serve)
        LS_OMP=active ROUNDS=$ROUNDS "$HERE/serve_compare.sh" "$HERE/serve_smollm2.jsonl" "$SMOL" ;;
    pp7b)  # llama.cpp's faster prefill on this CPU: no repack
        python "$HERE/compare.py" "$F7B" -p 512 -n 0 -r 1 --rounds "$ROUNDS" --peer-repack 0 --json \
            | show | json | tag pp7b >>"$HERE/compare_7b_issue12.jsonl" ;;
    tg7b)  # llama.cpp's faster decode on this CPU: repacked weights
        python "$HERE/compare.py" "$F7B" -p 0 -n 32 -r 1 --rounds "$ROUNDS" --peer-repack 1 --json \
            | show | json | tag tg7b >>"$HERE/compare_7b_issue12.jsonl" ;;
    kernels)
        memfit bench --kernels --shapes 7b --types Q4_0,Q4_K,Q5_K,Q6_K,Q8_0 --trials 3 --json \
            | show | json | tag kernels >>"$HERE/kernels_7b_issue12.jsonl" ;;
    small)
        python "$HERE/compare.py" "$SMOL" "$GEMMA" -p 512 -n 128 -r 3 --rounds "$ROUNDS" --peer-repack 1 --json \
            | show | json | tag small >>"$HERE/compare_small_issue12.jsonl" ;;
    interleaved)  # both runtimes in one process, 32-token blocks A B B A (see interleaved.py):
        # the ratio, then (--split) the output matrix's share of a token on each side
        PP="$HERE/../src:$(python -c 'import site; print(site.getsitepackages()[0])')"
        for m in "$SMOL" "$GEMMA"; do
            for split in "" --split; do
                PYTHONPATH="$PP" /root/peer-venv/bin/python "$HERE/interleaved.py" "$m" -n 32 \
                    --rounds $((ROUNDS * 4)) $split --json | show | json | tag interleaved >>"$HERE/interleaved_small.jsonl"
            done
        done ;;
    profile)
        memfit bench "$F7B" --profile -t 2 ;;
    budget)  # the pinned part of a streamed 7B must not regress
        memfit bench "$F7B" --mem-budget 2.5GiB -p 0 -n 8 -r 2 -t 2 --json \
            | show | json | tag budget >>"$HERE/budget_7b_issue12.jsonl" ;;
    serve7b)  # both servers in a 2.5 GiB cgroup, page cache dropped before each (pages cached
        # outside the cgroup are not charged to it); memfit at a 2.4 GiB budget, llama.cpp mmapped
        DROP_CACHES=1 CGROUP=2684354560 NP=16 CTX=256 N=8 R=4 ROUNDS=1 BENCH_ARGS=--logprobs \
            MEMFIT_ARGS="--mem-budget 2.4GiB" LS_ARGS="--no-repack -cram 0" \
            "$HERE/serve_compare.sh" "$HERE/serve_7b.jsonl" "$F7B" ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
    esac
done
