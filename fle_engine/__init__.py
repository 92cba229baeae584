"""FLE's CUDA-backed decoder for the files fle_quant makes (torch).

The forward passes, the expert cache and the server live here; this package
is the only part of FLE that imports torch."""

__version__ = "0.1.0"
