"""`memfit serve` through the official openai client: n choices, a list of prompts in one
completions request, and logit_bias, each compared with single requests."""

from __future__ import annotations

import pytest

from _server import ServerProcess

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.realmodel, pytest.mark.slow, pytest.mark.timeout(300)]

MSGS = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2", "-c", "1024", "-np", "4"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_n_choices_are_the_seeded_single_requests(client):
    r = client.chat.completions.create(model="smollm2", messages=MSGS, n=3, seed=7,
                                       temperature=1.0, max_tokens=12)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    n_gen = 0
    for i, t in enumerate(texts):   # choice i is the request with seed 7 + i
        one = client.chat.completions.create(model="smollm2", messages=MSGS, seed=7 + i,
                                             temperature=1.0, max_tokens=12)
        assert one.choices[0].message.content == t
        n_gen += one.usage.completion_tokens
    assert len(set(texts)) > 1
    # the prompt is counted once, every choice's tokens are counted
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == n_gen


def test_n_choices_streamed(client):
    chunks = list(client.chat.completions.create(model="smollm2", messages=MSGS, n=2, seed=3,
                                                 temperature=1.0, max_tokens=10, stream=True))
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    plain = client.chat.completions.create(model="smollm2", messages=MSGS, n=2, seed=3,
                                           temperature=1.0, max_tokens=10)
    assert [text[0], text[1]] == [c.message.content for c in plain.choices]
    assert set(finish) == {0, 1}


def test_list_of_prompts_in_one_completion(client):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    r = client.completions.create(model="smollm2", prompt=prompts, temperature=0, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for p, c in zip(prompts, r.choices):
        one = client.completions.create(model="smollm2", prompt=p, temperature=0, max_tokens=8)
        assert c.text == one.choices[0].text
    # n per prompt: choice index = prompt * n + j
    r2 = client.completions.create(model="smollm2", prompt=prompts[:2], n=2, temperature=0,
                                   max_tokens=4)
    want = [client.completions.create(model="smollm2", prompt=p, temperature=0,
                                      max_tokens=4).choices[0].text for p in prompts[:2]]
    assert [c.text for c in r2.choices] == [want[0], want[0], want[1], want[1]]


def test_logit_bias_bans_and_forces(client, server):
    import httpx
    base = client.completions.create(model="smollm2", prompt="The capital of France is",
                                     temperature=0, max_tokens=6, logprobs=1)
    first = base.choices[0].logprobs.tokens[0]
    tid = httpx.post(server.url + "/tokenize", json={"content": first}).json()["tokens"]
    assert len(tid) == 1
    banned = client.completions.create(model="smollm2", prompt="The capital of France is",
                                       temperature=0, max_tokens=6, logprobs=1,
                                       logit_bias={str(tid[0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    forced_id = httpx.post(server.url + "/tokenize", json={"content": " banana"}).json()["tokens"][0]
    forced = client.chat.completions.create(model="smollm2", messages=MSGS, temperature=0,
                                            max_tokens=4, logit_bias={str(forced_id): 100})
    piece = httpx.post(server.url + "/detokenize", json={"tokens": [forced_id]}).json()["content"]
    assert forced.choices[0].message.content.startswith(piece * 2)


def test_assistant_prefill_continues_the_final_message(client, server):
    import httpx
    msgs = [{"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "My favourite fruit is"}]
    p = httpx.post(server.url + "/apply-template", json={"messages": msgs}).json()["prompt"]
    assert p.endswith("<|im_start|>assistant\nMy favourite fruit is")
    r = client.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=8)
    same = client.completions.create(model="smollm2", prompt=p, temperature=0, max_tokens=8)
    assert r.choices[0].message.content == same.choices[0].text
    # vLLM's spelling of the same; both switches at once is a 400
    r2 = client.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=8,
                                        extra_body={"continue_final_message": True,
                                                    "add_generation_prompt": False})
    assert r2.choices[0].message.content == r.choices[0].message.content
    bad = httpx.post(server.base_url + "/chat/completions",
                     json={"messages": msgs, "continue_final_message": True,
                           "add_generation_prompt": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_server_chat_template_flag(smollm2_path, tmp_path):
    import httpx
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                   "{% if add_generation_prompt %}[assistant]{% endif %}")
    s = ServerProcess([str(smollm2_path), "-c", "256", "-np", "1", "--chat-template", str(tpl)])
    try:
        p = httpx.post(s.url + "/apply-template",
                       json={"messages": [{"role": "user", "content": "hi"}]}).json()["prompt"]
        assert p == "[user]hi[assistant]"
    finally:
        s.stop()
    s = ServerProcess([str(smollm2_path), "-c", "256", "-np", "1", "--chat-template", "llama3"])
    try:
        p = httpx.post(s.url + "/apply-template",
                       json={"messages": [{"role": "user", "content": "hi"}]}).json()["prompt"]
        assert p == "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>" \
                    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    finally:
        s.stop()
