"""One exception family for every error a user can cause.

The CLI prints these without a traceback and exits non-zero; the server maps them to
OpenAI-style error JSON. Internal invariants use ``assert`` instead.
"""


class MemfitError(Exception):
    """Base of all user-facing errors. The message names the bad value and what to do."""

    exit_code = 1


class GGUFError(MemfitError):
    """A GGUF file is malformed, truncated or inconsistent (the message names offset/field)."""


class UnsupportedError(MemfitError):
    """A valid file uses something memfit does not implement (architecture, quant type, ...)."""


class ModelError(MemfitError):
    """The model's tensors or metadata do not match what its architecture needs."""


class BudgetError(MemfitError):
    """The memory budget is too small; the message states the minimum that would work."""


class RequestError(MemfitError):
    """A bad argument or request (CLI flag, API call, HTTP body)."""


class WeightReadError(MemfitError):
    """Reading weights from the model file failed (I/O error, short read, file changed); the
    message names the file, the offset and the weights. The store is left clean: retry."""
