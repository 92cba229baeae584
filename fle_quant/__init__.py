"""FLE model surgery on GGUF files: streamed reading and writing, quant
formats, and a factory of small models. Importing it never imports torch."""

__version__ = "0.1.0"

from .errors import FleError  # noqa: E402
from .ggml_types import GGMLType  # noqa: E402

__all__ = ["FleError", "GGMLType", "__version__"]
