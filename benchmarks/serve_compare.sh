#!/bin/sh
# memfit serve and llama-server alternately (A B A B), one server at a time, same model file,
# slots (-np), context per slot, threads and requests; serve_bench.py JSON lines go to OUT.
#   ROUNDS=2 NP=16 CTX=512 N=32 R=32 LS=.../llama-server benchmarks/serve_compare.sh OUT.jsonl [MODEL]
# llama-server runs with OMP_WAIT_POLICY=passive (the client shares the 2 cores; see README);
# LS_OMP=active LS_TAG=-active ONLY_LS=1 runs llama-server alone with spinning OpenMP workers.
# CGROUP=BYTES runs each server inside a fresh memory cgroup of that size (in_cgroup.sh, as root;
# DROP_CACHES=1 drops the page cache before each); BENCH_ARGS go to serve_bench.py (e.g.
# --logprobs); the cgroup's peak usage is added to the JSON lines as cgroup_peak.
set -eu
OUT=$1; M=${2:-$HOME/.cache/memfit/models/SmolLM2-135M-Instruct.Q4_1.gguf}
ROUNDS=${ROUNDS:-2}; NP=${NP:-16}; CTX=${CTX:-512}; N=${N:-32}; R=${R:-32}; C=${C:-"1 4 16"}
LS=${LS:-/tmp/llama-server-build/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server}
PY=${PY:-python}; HERE=$(dirname "$0"); PORT=${PORT:-8097}
wait_up() { for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && return 0; sleep 0.5; done; return 1; }
one() {  # LABEL CMD...
    label=$1; shift
    log="/tmp/serve_compare.$label.log"
    if [ -n "${CGROUP:-}" ]; then
        "$HERE/in_cgroup.sh" "$CGROUP" "$@" >"$log" 2>&1 & pid=$!
        sleep 1; srv=$(pgrep -P "$pid" | head -1)
    else
        "$@" >"$log" 2>&1 & pid=$!; srv=$pid
    fi
    wait_up || { kill "$srv"; echo "$label did not come up" >&2; return 1; }
    rss=$(awk '/VmRSS/{print $2}' "/proc/$srv/status")
    tmp=$(mktemp)
    "$PY" "$HERE/serve_bench.py" --url "http://127.0.0.1:$PORT" -c $C -r "$R" -n "$N" \
        --label "$label" --json ${BENCH_ARGS:-} >"$tmp" || true
    kill "$srv"; wait "$pid" 2>/dev/null || true
    peak=$(sed -n 's/.*peak_usage=\([0-9?]*\).*oom_kill=\([0-9?]*\).*/\1, "cgroup_oom_kill": \2/p' "$log" | tail -1)
    sed "s/}\$/, \"rss_kib_up\": $rss, \"cgroup_peak\": ${peak:-null}}/" "$tmp" >>"$OUT"; rm -f "$tmp"
}
for r in $(seq "$ROUNDS"); do
    [ -n "${ONLY_LS:-}" ] || one memfit memfit serve "$M" --port "$PORT" -np "$NP" -c "$CTX" -t 2 ${MEMFIT_ARGS:-}
    one "llama-server${LS_TAG:-}" env OMP_WAIT_POLICY=${LS_OMP:-passive} "$LS" -m "$M" --port "$PORT" -np "$NP" \
        -c $((CTX * NP)) -t 2 ${LS_ARGS:-}
done
