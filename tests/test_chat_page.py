"""The chat page at / in a real headless Chromium (selenium) against a running `memfit serve`
with an API key: the page asks for the key, shows the model and the memory, streams an answer
(the same text the openai client gets), shows tokens/s, and its Stop button aborts a long
generation on the server (running requests back to 0). Skips when chromium/chromedriver are
not installed (Debian: apt-get install chromium chromium-driver).

MEMFIT_SCREENSHOT=PATH saves a screenshot of the page after an answer (docs/chat-page.png).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import httpx
import pytest

from _server import ServerProcess

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = [pytest.mark.realmodel, pytest.mark.slow, pytest.mark.timeout(300)]

KEY = "page-test-key-7f3a"
QUESTION = "What is the capital of France? Answer in one sentence."


def _browser_paths() -> tuple[str | None, str | None]:
    binary = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                   if shutil.which(b)), None)
    return binary, shutil.which("chromedriver")


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    keyfile = tmp_path_factory.mktemp("key") / "key"
    keyfile.write_text(KEY)
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2", "-c", "1024", "-np", "2",
                       "--mem-budget", "1GiB", "--api-key-file", str(keyfile)])
    s.headers = {"Authorization": f"Bearer {KEY}"}   # for ServerProcess.metrics()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    binary, driver = _browser_paths()
    if binary is None or driver is None:
        pytest.skip("chromium and chromedriver are not installed (Debian: apt-get install "
                    "chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1280,800", "--lang=en-US"):
        opts.add_argument(a)
    d = webdriver.Chrome(options=opts, service=webdriver.ChromeService(driver))
    d.set_page_load_timeout(60)
    yield d
    d.quit()


def _wait(d, cond, timeout=60.0, what="condition"):
    return WebDriverWait(d, timeout, poll_frequency=0.05).until(
        lambda _: cond(), message=f"timed out waiting for {what}")


def _last_answer(d):
    return d.execute_script(
        "const m = document.querySelectorAll('.msg.assistant');"
        "if (!m.length) return null; const a = m[m.length - 1];"
        "return {text: a.querySelector('.content').textContent, done: a.dataset.done || null,"
        "        note: (a.querySelector('.note') || {}).textContent || ''};")


def _send(d, text: str) -> None:
    box = d.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    d.find_element(By.ID, "send").click()


def _ready(d, server) -> None:
    """The page loaded with the key in its sessionStorage (as test_key_prompt leaves it)."""
    if d.current_url.startswith(server.url) and \
            d.find_element(By.ID, "model").text == "smollm2":
        return
    d.get(server.url + "/")
    d.execute_script("sessionStorage.setItem('memfit.apiKey', arguments[0])", KEY)
    d.refresh()
    _wait(d, lambda: d.find_element(By.ID, "model").text == "smollm2", 20, "the model name")


def test_page_is_public_and_self_contained(server):
    r = httpx.get(server.url + "/", timeout=10)   # no key: the page itself is public
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", r.text), "external asset"
    assert httpx.get(server.url + "/props", timeout=10).status_code == 401
    p = httpx.get(server.url + "/props", headers=server.headers, timeout=10).json()
    assert p["model_alias"] == "smollm2" and p["n_ctx"] == 1024 and p["total_slots"] == 2
    assert p["ready"] is True and p["rss_bytes"] > 0 and p["peak_rss_bytes"] >= p["rss_bytes"]
    assert p["mem_budget_bytes"] == 2**30 and p["mem_budget_enforced"] is True
    assert p["eos_token"] == "<|im_end|>" and p["pooling"] == "mean"


def test_key_prompt_then_model_and_memory(server, browser):
    d = browser
    d.get(server.url + "/")
    _wait(d, lambda: d.find_element(By.ID, "keybox").is_displayed(), 20, "the API key box")
    d.find_element(By.ID, "key").send_keys(KEY)
    d.find_element(By.ID, "keysave").click()
    _wait(d, lambda: d.find_element(By.ID, "model").text == "smollm2", 20, "the model name")
    assert not d.find_element(By.ID, "keybox").is_displayed()
    assert d.execute_script("return sessionStorage.getItem('memfit.apiKey')") == KEY
    assert re.fullmatch(r"\d+ MiB", d.find_element(By.ID, "rss").text)
    assert d.find_element(By.ID, "budget").text == "1.00 GiB"
    width = d.execute_script("return document.getElementById('meterbar').style.width")
    assert 0 < float(width.rstrip("%")) < 100          # RSS as a share of the budget
    assert d.find_element(By.ID, "ctx").text == "1024 × 2"


def test_streamed_answer_equals_api(server, browser):
    d = browser
    _ready(d, server)
    d.execute_script("document.getElementById('temperature').value = '0';"
                     "document.getElementById('max-tokens').value = '64';")
    # every state of the answer's text as the page updates it (a DOM observer in the page)
    d.execute_script(
        "window.__seen = []; new MutationObserver(() => {"
        "  const m = document.querySelectorAll('.msg.assistant .content');"
        "  if (m.length) window.__seen.push(m[m.length - 1].textContent);"
        "}).observe(document.getElementById('messages'),"
        "           {subtree: true, childList: true, characterData: true});")
    _send(d, QUESTION)
    _wait(d, lambda: (_last_answer(d) or {}).get("done"), 120, "the answer")
    a = _last_answer(d)
    assert a["done"] in ("stop", "length"), a
    seen = list(dict.fromkeys(t for t in d.execute_script("return window.__seen") if t))
    assert len(seen) >= 3, f"the answer did not stream: {seen}"    # shown piece by piece
    assert all(a["text"].startswith(t) for t in seen) and seen[-1] == a["text"]
    ref = httpx.post(server.base_url + "/chat/completions", headers=server.headers, timeout=120,
                     json={"model": "smollm2", "temperature": 0, "max_tokens": 64,
                           "messages": [{"role": "user", "content": QUESTION}]}).json()
    assert a["text"] == ref["choices"][0]["message"]["content"]
    assert "Paris" in a["text"]
    assert re.fullmatch(r"[\d.]+ tok/s", d.find_element(By.ID, "tps").text)
    assert f"{ref['usage']['completion_tokens']} tokens" in a["note"]
    shot = os.environ.get("MEMFIT_SCREENSHOT")
    if shot:
        d.execute_script("document.getElementById('input').blur()")
        d.save_screenshot(shot)


def test_stop_aborts_generation(server, browser):
    d = browser
    _ready(d, server)
    before = server.metrics().get("memfit_client_disconnects_total", 0.0)
    n_user = len(d.find_elements(By.CSS_SELECTOR, ".msg.user"))
    d.execute_script("document.getElementById('temperature').value = '0.8';"
                     "document.getElementById('max-tokens').value = '900';")
    # the answer must still be running when Stop is clicked: the page's requests get
    # ignore_eos (an answer that ended by itself just before the click counted no disconnect)
    d.execute_script("window.__fetch = window.fetch; window.fetch = (u, o) => {"
                     " if (!o || !o.body) return window.__fetch(u, o);"
                     " const b = JSON.parse(o.body); b.ignore_eos = true;"
                     " return window.__fetch(u, Object.assign({}, o, {body: JSON.stringify(b)})); };")
    _send(d, "Write a very long story about a lighthouse keeper, with many chapters.")
    _wait(d, lambda: len((_last_answer(d) or {}).get("text", "")) > 20, 60, "streamed text")
    assert server.metrics()["memfit_requests_running"] == 1
    assert d.find_element(By.ID, "stop").is_enabled()
    d.find_element(By.ID, "stop").click()
    _wait(d, lambda: _last_answer(d)["done"] == "stopped", 10, "the page to stop")
    deadline = time.monotonic() + 10
    while True:   # the engine's running count and the handler's disconnect count
        mt = server.metrics()
        if mt["memfit_requests_running"] == 0 and \
                mt["memfit_client_disconnects_total"] > before:
            break
        assert time.monotonic() < deadline, f"the server kept generating after Stop: {mt}"
        time.sleep(0.1)
    assert mt["memfit_client_disconnects_total"] == before + 1
    text = _last_answer(d)["text"]
    time.sleep(0.5)
    assert _last_answer(d)["text"] == text          # nothing more arrives
    assert "stopped" in _last_answer(d)["note"]
    assert d.find_element(By.ID, "send").is_enabled()
    d.execute_script("window.fetch = window.__fetch;")
    # the conversation goes on after a stop
    d.execute_script("document.getElementById('temperature').value = '0';"
                     "document.getElementById('max-tokens').value = '8';")
    _send(d, "Say hi.")
    _wait(d, lambda: _last_answer(d)["done"] in ("stop", "length"), 60, "the next answer")
    assert len(d.find_elements(By.CSS_SELECTOR, ".msg.user")) == n_user + 2


# ----------------------------------------------------------------------------- tools, reasoning

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}]
# chatml with the thinking block opened by the generation prompt and earlier turns' thinking
# dropped, as DeepSeek-R1's template does
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                  "{% if m['role'] == 'assistant' %}{{ (m['content'] or '').split('</think>')[-1] }}"
                  "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def _set(d, **values) -> None:
    """Settings fields by id (tool_choice -> #tool-choice)."""
    for k, v in values.items():
        d.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                         "e.dispatchEvent(new Event('change'));", k.replace("_", "-"), v)


def _new_chat(d) -> None:
    d.find_element(By.ID, "clear").click()
    _wait(d, lambda: not d.find_elements(By.CSS_SELECTOR, ".msg"), 5, "an empty conversation")


def test_tool_call_conversation(server, browser):
    d = browser
    _ready(d, server)
    _new_chat(d)
    _set(d, tools=json.dumps(WEATHER), tool_choice="required", temperature="0",
         max_tokens="64")
    # one call (OpenAI's parallel_tool_calls=false): with several allowed, SmolLM2 at
    # temperature 0 repeats the call until max_tokens on some kernel paths (AVX2)
    d.execute_script("document.getElementById('parallel-tool-calls').checked = false")
    question = "What is the weather in Paris?"
    _send(d, question)
    _wait(d, lambda: _last_answer(d)["done"], 120, "the tool call")
    assert _last_answer(d)["done"] == "tool_calls", _last_answer(d)
    shown = d.find_element(By.CSS_SELECTOR, ".msg.assistant .toolcall").text
    m = re.fullmatch(r"tool call get_weather\((.*)\)", shown, re.S)
    assert m, shown
    args = json.loads(m.group(1))
    assert isinstance(args["city"], str) and set(args) == {"city"}
    api = httpx.post(server.base_url + "/chat/completions", headers=server.headers, timeout=120,
                     json={"messages": [{"role": "user", "content": question}], "tools": WEATHER,
                           "tool_choice": "required", "temperature": 0, "max_tokens": 64,
                           "parallel_tool_calls": False}).json()
    call = api["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == args
    assert "get_weather" in d.find_element(By.ID, "input").get_attribute("placeholder")
    # the result, typed in the composer, goes back as a tool message; then a plain answer
    _set(d, tool_choice="none")
    _send(d, "18 degrees and sunny")
    _wait(d, lambda: _last_answer(d)["done"] in ("stop", "length"), 120, "the answer")
    assert d.find_element(By.CSS_SELECTOR, ".msg.tool .content").text == "18 degrees and sunny"
    page_answer = _last_answer(d)["text"]
    # the conversation the page keeps (and sent): call -> result -> answer
    conv = d.execute_script("return conversation")
    assert [x["role"] for x in conv] == ["user", "assistant", "tool", "assistant"]
    page_call = conv[1]["tool_calls"][0]
    assert page_call["function"] == {"name": "get_weather", "arguments": m.group(1)}
    assert conv[2] == {"role": "tool", "tool_call_id": page_call["id"],
                       "content": "18 degrees and sunny"}
    assert conv[3]["content"] == page_answer
    api2 = httpx.post(server.base_url + "/chat/completions", headers=server.headers, timeout=120,
                      json={"messages": conv[:3], "tools": WEATHER, "tool_choice": "none",
                            "temperature": 0, "max_tokens": 64}).json()
    assert page_answer == api2["choices"][0]["message"]["content"]
    _set(d, tools="", tool_choice="auto")


@pytest.fixture(scope="module")
def think_server(smollm2_path, tmp_path_factory):
    t = tmp_path_factory.mktemp("tpl") / "think.jinja"
    t.write_text(THINK_TEMPLATE)
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2-think", "-c", "512", "-np", "1",
                       "--chat-template-file", str(t)])
    yield s
    s.stop()


def test_reasoning_shown_apart(think_server, browser):
    d = browser
    d.get(think_server.url + "/")    # no API key on this server: no key box
    _wait(d, lambda: d.find_element(By.ID, "model").text == "smollm2-think", 20, "the model")
    assert not d.find_element(By.ID, "keybox").is_displayed()
    _set(d, temperature="0", max_tokens="48")
    question = "Is 17 a prime number?"
    _send(d, question)
    _wait(d, lambda: _last_answer(d)["done"], 120, "the answer")
    shown = d.execute_script(
        "const b = document.querySelector('.msg.assistant details.reasoning .text');"
        "return b ? b.textContent : null;")
    api = httpx.post(think_server.base_url + "/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": question}], "temperature": 0,
        "max_tokens": 48}).json()["choices"][0]["message"]
    assert api.get("reasoning_content"), api
    assert shown == api["reasoning_content"]
    assert _last_answer(d)["text"] == (api["content"] or "")
