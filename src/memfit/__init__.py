"""memfit: run GGUF language models inside a hard memory budget."""

from .errors import MemfitError

__version__ = "0.1.0"
__all__ = ["MemfitError", "load", "__version__"]


def load(model=None, **kwargs):
    """Load a model from a GGUF path or a built-in name (see memfit.api.Model)."""
    from .api import Model
    return Model(model, **kwargs)
