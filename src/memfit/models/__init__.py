"""Model architectures: one short file each over shared blocks (layers.py), and a registry.

    model = load_model(path | GGUFFile | metadata_dict, weights=None, ops=None)
    cache = model.new_cache(n_ctx)
    logits = model.forward(ids, cache, all_logits=False)   # f32 [n_vocab] or [n, n_vocab]
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UnsupportedError
from .config import ModelConfig
from .deepseek2 import Deepseek2
from .gemma3 import Gemma3
from .glm4moe import Glm4Moe
from .glmdsa import GlmDsa
from .gptoss import GptOss
from .layers import Model
from .llama import Llama
from .olmoe import Olmoe
from .qwen2 import Qwen2
from .qwen2moe import Qwen2Moe
from .qwen3 import Qwen3
from .qwen3moe import Qwen3Moe
from .spec import ArchSpec, config_from_gguf, get_spec, tensor_roles
from .weights import GGUFWeights, WeightSource

# general.architecture -> Model class (its ``spec`` is the ArchSpec); Mixtral is "llama"
REGISTRY: dict[str, type[Model]] = {
    "llama": Llama, "qwen2": Qwen2, "qwen3": Qwen3, "gemma3": Gemma3,
    "qwen2moe": Qwen2Moe, "qwen3moe": Qwen3Moe, "olmoe": Olmoe, "glm4moe": Glm4Moe,
    "deepseek2": Deepseek2, "glm-dsa": GlmDsa, "gpt-oss": GptOss,
}


def load_model(source, weights: WeightSource | None = None, ops=None) -> Model:
    """Build the model for a GGUF path, an open GGUFFile, or a metadata dict plus a
    WeightSource. Checks every tensor's presence, shape and type before returning."""
    opened = None
    if isinstance(source, (str, Path)):
        from ..gguf import open_gguf
        source = opened = open_gguf(source)
    if isinstance(source, dict):
        metadata = source
        assert weights is not None, "a metadata dict needs a WeightSource"
    else:
        metadata = source.metadata
        weights = weights if weights is not None else GGUFWeights(source)
    try:
        arch = metadata.get("general.architecture")
        cls = REGISTRY.get(arch)
        if cls is None:
            raise UnsupportedError(f"architecture {arch!r} is not supported; supported: "
                                   f"{', '.join(sorted(REGISTRY))}")
        if not metadata.get(f"{arch}.vocab_size") and not metadata.get("tokenizer.ggml.tokens") \
                and weights.has("token_embd.weight"):
            metadata = {**metadata, f"{arch}.vocab_size": weights.info("token_embd.weight")[0][0]}
        model = cls(ModelConfig.from_metadata(metadata), weights, ops)
    except BaseException:
        if opened is not None:
            opened.close()
        raise
    model.file = opened
    return model


__all__ = ["REGISTRY", "ArchSpec", "Model", "ModelConfig", "GGUFWeights", "WeightSource",
           "config_from_gguf", "get_spec", "load_model", "tensor_roles"]
