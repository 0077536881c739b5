"""Speculative decoding through `memfit serve` and the CLI: the same text with and without it
(per request `speculative.n_max`, the server's `--spec`), its counters on /metrics, `run`'s
summary and `--json`, and the flags' errors."""

from __future__ import annotations

import json

import httpx
import pytest

from _server import ServerProcess, run_cli

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.realmodel, pytest.mark.slow, pytest.mark.timeout(300)]

COPY = ("Copy this list exactly: red, green, blue, yellow, purple, orange, black, white, "
        "grey, brown. Copy: red, green, blue, yellow, purple, orange, black, white, grey, brown."
        " Copy again:")


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2", "-c", "1024", "-np", "4",
                       "--spec", "ngram", "--draft-max", "12"])
    yield s
    s.stop()


def test_same_text_with_and_without_speculation_and_metrics(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": COPY}]
    on = client.chat.completions.create(model="smollm2", messages=msgs, temperature=0,
                                        max_tokens=48)
    off = client.chat.completions.create(model="smollm2", messages=msgs, temperature=0,
                                         max_tokens=48, extra_body={"speculative.n_max": 0})
    assert on.choices[0].message.content == off.choices[0].message.content
    seeded = [client.completions.create(model="smollm2", prompt=COPY, temperature=0.9, seed=5,
                                        max_tokens=32, extra_body={"speculative.n_max": n})
              for n in (0, 8)]
    assert seeded[0].choices[0].text == seeded[1].choices[0].text
    m = httpx.get(server.url + "/metrics").text
    acc = [ln for ln in m.splitlines() if ln.startswith('memfit_spec_accepted_tokens{proposer="ngram"}')]
    assert acc and float(acc[0].split()[-1]) > 0, m[-2000:]
    bad = httpx.post(server.url + "/v1/chat/completions",
                     json={"model": "smollm2", "messages": msgs, "speculative.n_max": -2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative.n_max"


def test_run_summary_and_json(smollm2_path):
    r = run_cli(["run", str(smollm2_path), "-p", COPY, "--temp", "0", "-n", "32", "--spec",
                 "ngram"])
    assert r.returncode == 0, r.stderr
    summary = r.stderr.strip().splitlines()[-1]
    assert "generated 32 tok" in summary and "| spec ngram: ngram " in summary and "accepted" in summary
    j = run_cli(["run", str(smollm2_path), "-p", COPY, "--temp", "0", "-n", "32", "--json",
                 "--spec", "ngram"])
    d = json.loads(j.stdout)
    assert d["spec"]["mode"] == "ngram" and d["spec"]["proposed"] > 0
    off = json.loads(run_cli(["run", str(smollm2_path), "-p", COPY, "--temp", "0", "-n", "32",
                              "--json", "--spec", "off"]).stdout)
    assert off["ids"] == d["ids"] and off["spec"] is None


@pytest.mark.parametrize("args, msg", [
    (["--spec", "draft"], "needs a draft model"),
    (["--spec", "bogus"], "invalid choice"),
    (["--draft-max", "-3"], "too small"),
    (["--draft-min", "9", "--draft-max", "4"], "above --draft-max"),
])
def test_flag_errors(smollm2_path, args, msg):
    r = run_cli(["run", str(smollm2_path), "-p", "x", "-n", "2"] + args)
    assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2


def test_bench_spec_curve_and_mode(smollm2_path):
    r = run_cli(["bench", str(smollm2_path), "--spec", "-p", "16", "-r", "1", "--json"])
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["rows"] for x in rows] == [1, 2, 4, 8, 16, 24] and rows[0]["ratio"] == 1.0
    r = run_cli(["bench", str(smollm2_path), "--spec", "ngram", "-n", "48", "-r", "1", "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["same_tokens"] is True and d["spec"]["proposed"] > 0
