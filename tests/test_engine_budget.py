"""Many sequences under a memory budget, end to end: a real `memfit bench --parallel 8`
process whose peak RSS (VmHWM, read at exit and polled from /proc) stays within the budget
while the weights stream, with the KV pool exactly the planner's KV reservation."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

MiB = 1 << 20
WRAP = ("import runpy, sys\n"
        "sys.argv = ['memfit', *sys.argv[1:]]\n"
        "try:\n"
        "    runpy.run_module('memfit', run_name='__main__', alter_sys=True)\n"
        "finally:\n"
        "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
        "    print('MEMFIT_TEST_VMHWM_KB', hwm.split()[1], file=sys.stderr, flush=True)\n")


def _run(args, env):
    import os
    e = {k: v for k, v in os.environ.items() if k != "MEMFIT_MEM_BUDGET"}
    e.update(env)
    p = subprocess.Popen([sys.executable, "-c", WRAP, *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=e)
    res: dict = {}
    t = threading.Thread(target=lambda: res.update(zip(("out", "err"), p.communicate())))
    t.start()
    polled = 0
    while t.is_alive():
        try:
            with open(f"/proc/{p.pid}/status") as f:
                polled = max([polled] + [int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:")])
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    t.join()
    assert p.returncode == 0, res["err"][-3000:]
    hwm = [int(x.split()[1]) * 1024 for x in res["err"].splitlines()
           if x.startswith("MEMFIT_TEST_VMHWM_KB")]
    return res["out"], max(polled, *hwm)


@pytest.mark.realmodel
@pytest.mark.timeout(300)
def test_eight_sequences_within_budget(smollm2_path):
    budget = 190 * MiB  # SmolLM2's floor at this context is ~165 MiB: part of it streams
    out, peak = _run(["bench", smollm2_path, "--parallel", 8, "-p", 40, "-n", 8, "-r", 1,
                      "--json", "--mem-budget", budget], {"MEMFIT_DEBUG_LEDGER": "1"})
    d = json.loads(out.strip().splitlines()[-1])
    assert d["parallel"] == 8 and d["tokens_per_s"] > 0
    assert d["bytes_read"] > 0, "the budget did not make the weights stream"
    assert peak <= budget, f"peak RSS {peak / MiB:.1f} MiB > budget {budget / MiB:.1f} MiB"
    assert d["peak_rss_bytes"] <= budget
    # the pool is what the planner reserved for 8 sequences, and it never grew
    assert d["kv_pool_bytes"] == d["plan_kv_bytes"] > 0
    assert d["kv_blocks_total"] == 8 * 2  # 8 x ceil((40 + 8 + 8 + 8) / 32) blocks
