"""A prompt's tokenizer and template memory is part of the budget: a real `memfit serve` under a
budget near its floor is sent oversized prompts (one, and six at once as chat messages) and a
valid prompt just under the context; peak RSS (VmHWM, from the kernel) stays under the budget
and RSS returns to where it was. Tokenizing in bounded pieces gives the ids of one whole encode."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import threading

import httpx
import pytest

from _server import ServerProcess

CTX = 2048
MiB = 1 << 20


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _floor_mib(args: list[str]) -> int:
    """The smallest --mem-budget the planner accepts for these arguments (from its refusal)."""
    p = subprocess.run([sys.executable, "-m", "memfit", "serve", "--mem-budget", "1MiB", *args],
                       capture_output=True, text=True, timeout=120)
    m = re.search(r"raise --mem-budget to at least (\d+)MiB", p.stderr)
    assert p.returncode != 0 and m, p.stderr
    return int(m.group(1))


def _context_error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "context_length_exceeded"
    assert err["param"] == param
    assert f"the context is {CTX}" in err["message"], err["message"]
    return err["message"]


@pytest.mark.realmodel
def test_oversized_prompts_stay_in_budget(smollm2_path):
    args = ["-c", str(CTX), "-np", "2"]
    budget = (_floor_mib(args) + 2) * MiB
    s = ServerProcess(["--mem-budget", str(budget), *args])
    try:
        pid = s.proc.pid
        url = s.url
        client = httpx.Client(timeout=300)
        # warm: lazy imports (template engine, sampler) and first-use allocations come before
        # the RSS the load is compared with
        r = client.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = client.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        before = _status(pid)["VmRSS"]

        # (a) one ~960 kB prompt: refused from the first pieces, naming the context
        words = "the quick brown fox jumps over the lazy dog, again and again. "
        big = (words * (960_000 // len(words) + 1))[:960_000]
        msg = _context_error(client.post(url + "/v1/completions",
                                         json={"prompt": big, "max_tokens": 1}), "prompt")
        n = int(re.search(r"at least (\d+) tokens", msg).group(1))
        assert n >= CTX

        # texts with no exact cut for a long stretch (one letter run, one CJK run, digits,
        # punctuation): each is refused, none tokenized whole
        for text in ("a" * 900_000, "漢字かな" * 80_000, "7" * 900_000, "!?" * 450_000,
                     "a" * 150_000, "xq" * 80_000):
            _context_error(client.post(url + "/v1/completions",
                                       json={"prompt": text, "max_tokens": 1}), "prompt")

        # a stretch too long to tokenize at once whose length cannot prove it too long
        for path, body, param in (("/v1/completions", {"prompt": "q" * 20_000}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [
                                      {"role": "user", "content": "q" * 20_000}]}, "messages")):
            r = client.post(url + path, json={**body, "max_tokens": 1})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and "no word boundary" in err["message"], err

        # token ids past the context: refused before they are checked one by one
        msg = _context_error(client.post(url + "/v1/completions", json={
            "prompt": [100] * 150_000, "max_tokens": 1}), "prompt")
        assert "at least 150000 tokens" in msg, msg

        # (b) six ~900 kB chat messages at once
        content = ("hello world, " * 70_000)[:900_000]
        out: list[httpx.Response] = []

        def chat():
            out.append(httpx.post(url + "/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "user", "content": content}], "max_tokens": 1}))
        threads = [threading.Thread(target=chat) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(out) == 6
        for r in out:
            _context_error(r, "messages")

        # (c) a valid prompt just under the context: 200; one token more: 400
        def prompt_of(n_tok: int) -> str:
            text = "hello" + " hello" * (n_tok - 1)
            ids = client.post(url + "/tokenize", json={"content": text, "add_special": True}
                              ).json()["tokens"]
            assert len(ids) == n_tok
            return text
        r = client.post(url + "/v1/completions",
                        json={"prompt": prompt_of(CTX - 1), "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == CTX - 1
        msg = _context_error(client.post(url + "/v1/completions", json={
            "prompt": prompt_of(CTX), "max_tokens": 1}), "prompt")
        assert int(re.search(r"at least (\d+) tokens", msg).group(1)) >= CTX, msg

        st = _status(pid)
        assert st["VmHWM"] <= budget, (st, budget)
        assert st["VmRSS"] - before <= 16 * MiB, (st, before)
        assert s.proc.poll() is None
    finally:
        s.stop()


def _tok(path, pre: str | None = None):
    from memfit.gguf import open_gguf
    from memfit.tokenizer import Tokenizer
    with open_gguf(path) as f:
        md = dict(f.metadata)
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    return Tokenizer.from_metadata(md)


def _texts(specials: list[str]) -> list[str]:
    rnd = random.Random(17)
    atoms = list("aZq .,;:'\"!?-_\n\t 0123456789()[]<>/\\@#$%&*=+~`|") + [
        "  ", "\r\n", "\n\n", "'s", "'T", "'ll", "é", "e\u0301", "漢", "字", "か", "😀", "\u2581",
        "\u00a0", "\u3000", "\x1c", "\x00", " cat", "The", "1234", "> </", ">\u2581</",
        *specials]
    out = [
        "",
        "Hello world, this is a normal sentence. And another one!\n" * 40,
        "a" * 5000 + " b" + "c" * 3000,                # long runs without whitespace
        "漢字かなカナ、中文。" * 400 + "\n" + "日本語" * 300,
        "x" * 2000 + "7" * 2000 + "!?" * 1000 + "\t\t" + "  " * 500,
        "naïve café — “quoted” ünïcödé 😀🎉 " * 80,
        "".join(specials) * 20 + "".join(s + " x " for s in specials) * 10,
        "".join(f"q{chr(0x2581) * k} {chr(0x2581) * j}zebra " for k in range(4) for j in range(4)) * 8,
    ]
    for k, n in ((30, 6), (200, 6), (2000, 3), (6000, 2)):   # the long ones cost the time
        for _ in range(n):
            out.append("".join(rnd.choice(atoms) for _ in range(k)))
    return out


@pytest.mark.realmodel
@pytest.mark.parametrize("fixture,pre", [("smollm2_path", None), ("smollm2_path", "llama3"),
                                         ("smollm2_path", "qwen2"), ("smollm2_path", "default"),
                                         ("smollm2_path", "gpt-2"), ("smollm2_path", "falcon"),
                                         ("gemma_path", None)])
def test_bounded_encode_equals_whole_encode(request, fixture, pre):
    """encode_limited (and iter_encode) in small pieces: the ids of one whole encode, on texts
    with special tokens, long runs without whitespace and unicode; with the SmolLM2 vocabulary
    under every pre-tokenizer family's regexes too (the cut rules must hold for each)."""
    from memfit.tokenizer.vocab import TooManyTokens
    tok = _tok(request.getfixturevalue(fixture), pre)
    specials = [t for t, _, _ in tok._special[:12]] + ["<|im_start|>", "<start_of_turn>"]
    cut_pieces = 0
    for text in _texts(specials):
        for parse_special in (True, False):
            want = tok.encode(text, parse_special=parse_special)
            for piece in (1, 7, 64):
                got = tok.encode_limited(text, 10**9, parse_special=parse_special,
                                         piece_chars=piece)
                assert got == want, (piece, text[:120])
                parts = list(tok.iter_encode(text, parse_special=parse_special, piece_chars=piece))
                assert [i for p in parts for i in p] == want, (piece, text[:120])
                cut_pieces += len(parts)
            if tok.kind == "gpt2":
                # the pre-tokens too (a vocabulary without multi-digit tokens, as SmolLM2's,
                # would hide a cut inside llama3's 3-digit groups from the ids)
                pre = tok._hf.pre_tokenizer.pre_tokenize_str
                start, cut = 0, []
                while start < len(text):
                    end = tok._safe_cut(text, start + 3)
                    cut += [p for p, _ in pre(text[start:end])]
                    start = end
                assert cut == [p for p, _ in pre(text)], text[:120]
            if want:
                # exactly at the limit passes; one under is refused with a true lower bound
                assert tok.encode_limited(text, len(want), parse_special=parse_special,
                                          piece_chars=7) == want
                with pytest.raises(TooManyTokens) as e:
                    tok.encode_limited(text, len(want) - 1, parse_special=parse_special,
                                       piece_chars=7)
                assert len(want) - 1 < e.value.n_at_least <= len(want)
    assert cut_pieces > 2000   # the texts were really cut, not encoded whole


@pytest.mark.realmodel
def test_prompt_limit_and_tokenize_stop_early(smollm2_path):
    """--max-prompt-tokens is the limit tokenizing stops at (named in the 400); /tokenize counts
    up to the context and refuses more the same way; a stretch with no exact cut too long to
    tokenize at once is a clear 400, not a tokenizer run of unbounded memory."""
    s = ServerProcess(["-c", "256", "-np", "1", "--max-prompt-tokens", "50"])
    try:
        c = httpx.Client(base_url=s.url, timeout=120)
        r = c.post("/v1/completions", json={"prompt": "hello " * 150_000, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert "at most 50 (--max-prompt-tokens)" in err["message"], err
        r = c.post("/v1/completions", json={"prompt": "hello" + " hello" * 49, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 50

        ids = c.post("/tokenize", json={"content": "hello" + " hello" * 255}).json()["tokens"]
        assert len(ids) == 256                      # the whole context
        r = c.post("/tokenize", json={"content": "hello " * 150_000})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "content" and "the context is 256" in err["message"], err
    finally:
        s.stop()


@pytest.mark.realmodel
def test_uncuttable_stretch_is_refused_in_one_line(smollm2_path):
    from memfit.errors import RequestError
    tok = _tok(smollm2_path)
    text = "q" * 40_000                              # one pre-token, ~2.5k tokens or more
    with pytest.raises(RequestError, match="no word boundary") as e:
        tok.encode_limited(text, 100_000)
    assert "\n" not in str(e.value)
    # short enough to take at once: the same ids as one encode
    assert tok.encode_limited(text[:16_000], 100_000) == tok.encode(text[:16_000])


@pytest.mark.realmodel
def test_run_and_generate_tokenize_a_huge_prompt_bounded(tmp_path, smollm2_path):
    # `memfit run -f` of a 20 MB text with a 256-token context: refused from its first pieces
    # in one line, in a process whose peak RSS stays near the loaded model's (tokenizing the
    # whole text first took ~3 GB and ~70 s here)
    words = "the quick brown fox jumps over the lazy dog, again and again. "
    path = tmp_path / "big.txt"
    path.write_text(words * (20_000_000 // len(words)))
    # VmHWM, not getrusage's ru_maxrss: that one survives execve, so it would carry pytest's own
    code = ("import sys\nfrom memfit.cli import main\n"
            "from memfit.memory.budget import peak_rss\n"
            "try:\n    rc = main(sys.argv[1:])\nfinally:\n"
            "    print('maxrss', peak_rss() // 1024, file=sys.stderr)\n"
            "sys.exit(rc)\n")
    p = subprocess.run([sys.executable, "-c", code, "run", str(smollm2_path), "-f", str(path),
                        "-c", "256", "-n", "4"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    errs = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert len(errs) == 1 and re.search(r"at least \d+ tokens but the context is 256", errs[0]), p.stderr
    assert "Traceback" not in p.stderr
    maxrss_kib = int(re.search(r"maxrss (\d+)", p.stderr).group(1))
    assert maxrss_kib * 1024 < 400 * MiB, maxrss_kib

    import memfit
    with memfit.load(str(smollm2_path), n_ctx=128) as m:
        from memfit.errors import RequestError
        with pytest.raises(RequestError, match=r"at least \d+ tokens but the context is 128"):
            m.generate(words * 200_000, max_tokens=1)
        with pytest.raises(RequestError, match=r"has 500 tokens but the context is 128"):
            m.generate([1] * 500, max_tokens=1)
        assert m.generate("Hello", max_tokens=2).ids  # a prompt that fits still runs


@pytest.mark.realmodel
def test_response_store_is_in_the_budget(smollm2_path):
    """The Responses store's bytes are planned (--response-store raises the floor by as much)
    and booked in the ledger: a real `memfit serve` near its floor, sent many large stored
    responses, evicts the oldest, keeps the store within its share, reports its bytes in
    /metrics and /props (the ledger's "server" category), and VmHWM stays under the budget."""
    args = ["-c", "1024", "-np", "1"]
    floor = _floor_mib(args + ["--response-store", "1MiB"])
    assert _floor_mib(args + ["--response-store", "9MiB"]) == floor + 8
    budget = (floor + 2) * MiB
    s = ServerProcess(["--mem-budget", str(budget), "--response-store", "1MiB", *args])
    try:
        url, client = s.url, httpx.Client(timeout=120)
        # 16 metadata values of 512 characters: ~9 kB a response, echoed and stored
        meta = {f"k{j}": f"{j:x}" * 512 for j in range(16)}
        meta = {k: v[:512] for k, v in meta.items()}
        ids = []
        for i in range(160):
            r = client.post(url + "/v1/responses", json={
                "model": "smollm2-135m", "input": f"Note {i}.", "max_output_tokens": 1,
                "metadata": meta})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        props = client.get(url + "/props").json()
        st = props["response_store"]
        assert st["max_bytes"] == MiB and 0 < st["bytes"] <= MiB
        assert st["evicted"] > 0 and st["entries"] + st["evicted"] == len(ids)
        assert props["ledger"]["server"] == st["bytes"]
        assert sum(props["ledger"].values()) <= budget
        m = s.metrics()
        assert m["memfit_response_store_bytes"] == st["bytes"]
        assert m["memfit_response_store_evictions"] == st["evicted"]
        assert m["memfit_response_store_max_bytes"] == MiB
        # the oldest were evicted (404), the newest are kept and can be continued
        assert client.get(url + f"/v1/responses/{ids[0]}").status_code == 404
        assert client.get(url + f"/v1/responses/{ids[-1]}").json()["metadata"] == meta
        r = client.post(url + "/v1/responses", json={
            "model": "smollm2-135m", "input": "And then?", "max_output_tokens": 1,
            "previous_response_id": ids[-1]})
        assert r.status_code == 200, r.text
        hwm = _status(s.proc.pid)["VmHWM"]
        print(f"floor {floor} MiB, budget {budget / MiB:.0f} MiB, VmHWM {hwm / MiB:.1f} MiB, "
              f"store {st['bytes']} B in {st['entries']} entries, {st['evicted']} evicted, "
              f"ledger {sum(props['ledger'].values()) / MiB:.1f} MiB")
        assert hwm <= budget, f"VmHWM {hwm / MiB:.1f} MiB > budget {budget / MiB:.1f} MiB"
    finally:
        s.stop()
