#!/usr/bin/env bash
# Issue 10: aggregate decode tok/s at N concurrent sequences, each JSON line annotated with
# the commit, a label and the 1-minute load average before/after (the machine is shared).
# Usage: benchmarks/parallel_bench.sh LABEL OUT.jsonl [memfit bench args...]
#   env CGROUP=BYTES : run inside benchmarks/in_cgroup.sh BYTES with DROP_CACHES=1
set -u
label=$1; out=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
head=$(git -C "$here" rev-parse HEAD)
l0=$(cut -d' ' -f1 /proc/loadavg)
if [ -n "${CGROUP:-}" ]; then
  res=$(DROP_CACHES=1 "$here/in_cgroup.sh" "$CGROUP" memfit bench "$@" --json 2>/tmp/pb_err.$$)
  cg=$(grep '^# cgroup' /tmp/pb_err.$$ | tail -1)
else
  res=$(memfit bench "$@" --json 2>/tmp/pb_err.$$); cg=""
fi
l1=$(cut -d' ' -f1 /proc/loadavg)
tail -2 /tmp/pb_err.$$ >&2; rm -f /tmp/pb_err.$$
printf '%s\n' "$res" | python3 -c '
import json, sys
label, head, l0, l1, cg = sys.argv[1:6]
for line in sys.stdin:
    if line.strip().startswith("{"):
        d = json.loads(line)
        d.update(label=label, commit=head, load1_before=float(l0), load1_after=float(l1))
        if cg: d["cgroup"] = cg
        print(json.dumps(d))' "$label" "$head" "$l0" "$l1" "$cg" | tee -a "$out"
