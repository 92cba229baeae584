"""Calibration texts for the tests that run the model over text: words of
the project's own vocabulary in a seeded random order."""
from __future__ import annotations

import random
from pathlib import Path

WORDS = ("the model reads a file of tensors and writes another one each layer has a router experts and a "
         "shared expert quantization stores weights in small blocks with one scale per block while the "
         "engine reads only what it needs numbers such as 2048 512 and 10 are sizes").split()


def write_text(path: Path, n_words: int = 2500, seed: int = 0) -> Path:
    """``n_words`` of :data:`WORDS` drawn with ``random.Random(seed)``, one line."""
    rng = random.Random(seed)
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(n_words)) + "\n", encoding="utf-8")
    return path
