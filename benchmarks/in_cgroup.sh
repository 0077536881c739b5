#!/usr/bin/env bash
# Run CMD inside a fresh memory cgroup limited to LIMIT bytes (page cache is charged to it).
# Usage (as root): benchmarks/in_cgroup.sh LIMIT_BYTES CMD [ARGS...]
#   env DROP_CACHES=1 : sync and drop the page cache first (cold start)
# Prints "# cgroup: ..." lines to stderr: peak usage, OOM-kill count, exit status.
# cgroup v2 (memory.max) when the memory controller is available there, else v1 under the
# caller's own memory cgroup (memory.limit_in_bytes; swap is absent on the bench machine).
set -u
limit=$1; shift
name="memfit-bench-$$"
if [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
  cg=/sys/fs/cgroup/$name; mkdir "$cg" || exit 3
  echo "$limit" > "$cg/memory.max"; echo 0 > "$cg/memory.swap.max" 2>/dev/null
  peak_file=memory.peak; v=2
else
  parent=/sys/fs/cgroup/memory$(awk -F: '$2=="memory"{print $3}' /proc/self/cgroup)
  cg=$parent/$name; mkdir "$cg" || exit 3
  echo "$limit" > "$cg/memory.limit_in_bytes"
  peak_file=memory.max_usage_in_bytes; v=1
fi
if [ "${DROP_CACHES:-0}" = 1 ]; then sync; echo 3 > /proc/sys/vm/drop_caches; fi
# The child moves itself into the cgroup, then execs CMD (so everything it starts is charged).
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$cg" "$@"
rc=$?
peak=$(cat "$cg/$peak_file" 2>/dev/null || echo "?")
if [ $v = 2 ]; then oom=$(awk '$1=="oom_kill"{print $2}' "$cg/memory.events")
else oom=$(awk '$1=="oom_kill"{print $2}' "$cg/memory.oom_control"); fi
echo "# cgroup v$v limit=$limit peak_usage=$peak oom_kill=${oom:-?} rc=$rc" >&2
rmdir "$cg" 2>/dev/null || true
exit $rc
