"""`memfit run --json-schema FILE | --grammar FILE | --regex RE`, as a user types them: real
`memfit` processes. A good constraint shapes the output; a bad file, schema, grammar or
regex is one line `memfit: error: argument ...: ...`, exit 2, before any model loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import jsonschema
import pytest

from schemas import SCHEMAS

M = "smollm2-135m"


def _run(args, cwd):
    e = dict(os.environ)
    e.pop("MEMFIT_MEM_BUDGET", None)
    return subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, stdin=subprocess.DEVNULL, env=e)


def test_run_json_schema_grammar_regex(tmp_path, smollm2_path):
    name, schema = SCHEMAS[1]
    (tmp_path / "s.json").write_text(json.dumps(schema))
    p = _run(["run", str(smollm2_path), "-p", "Give a person and an address.", "--chat",
              "--json-schema", "s.json", "--temp", "0", "-n", "200", "--json"], tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), schema)
    # streamed text (what a user sees), a GBNF grammar file
    (tmp_path / "g.gbnf").write_text('root ::= "Answer: " ("yes" | "no")\n')
    p = _run(["run", str(smollm2_path), "-p", "Is the sky blue?", "--chat", "--grammar", "g.gbnf",
              "--temp", "0"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert re.fullmatch(r"Answer: (yes|no)\n", p.stdout), p.stdout
    assert "finish stop" in p.stderr
    p = _run(["run", str(smollm2_path), "-p", "The year was", "--no-echo", "--regex",
              " (19|20)[0-9]{2}", "--temp", "0.9", "-s", "4"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert re.fullmatch(r" (19|20)[0-9]{2}\n", p.stdout), p.stdout


BAD = [
    (["--json-schema", "missing.json"], "argument --json-schema: cannot read missing.json"),
    (["--json-schema", "notjson.json"], "notjson.json is not JSON"),
    (["--json-schema", "list.json"], "must hold a JSON object"),
    (["--json-schema", "unsupported.json"], 'Unimplemented keys: ["uniqueItems"]'),
    (["--grammar", "bad.lark"], "unknown name"),
    (["--grammar", "bad.gbnf"], "Rule 'nothing' not found"),
    (["--regex", "a("], "argument --regex"),
    (["--regex", "a", "--grammar", "bad.gbnf"], "argument --grammar"),
    (["--regex", "a", "--json-schema", "good.json"], "not allowed with argument"),
]


@pytest.mark.parametrize("args, needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_constraint_is_one_line_exit_2(tmp_path, args, needle):
    (tmp_path / "notjson.json").write_text("{nope")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "good.json").write_text('{"type": "object"}')
    (tmp_path / "unsupported.json").write_text('{"type": "array", "uniqueItems": true}')
    (tmp_path / "bad.lark").write_text("start: foo\n")
    (tmp_path / "bad.gbnf").write_text('root ::= "a" nothing\n')
    t0 = time.perf_counter()
    p = _run(["run", M, "-p", "hi", *args], tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("memfit: error:"), p.stderr
    assert needle in lines[0], lines[0]
    assert "loading" not in p.stderr and p.stdout == ""
    assert time.perf_counter() - t0 < 30
