"""Console scripts of fle_quant (declared in pyproject.toml)."""
