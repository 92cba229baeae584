"""The byte-permute decoders of the GPU kernels' fast paths, run as the
same op lists in numpy: every nibble and byte value comes out as the code
book or the int8 value says, and the PTX text is printed from those lists."""
from __future__ import annotations

import numpy as np

from fle_engine.kernels import ptx_decode as pd
from fle_quant.quants import tables


def _all_words(rng, n=4096):
    q = rng.integers(0, 2 ** 32, size=n, dtype=np.uint64).astype(np.uint32)
    # every nibble value in every position, and the extremes
    each = np.array([int("".join([f"{v:x}"] * 8), 16) for v in range(16)], dtype=np.uint32)
    return np.concatenate([q, each, np.array([0, 0xFFFFFFFF, 0x80808080, 0x7F7F7F7F], dtype=np.uint32)])


def test_iq4_program_gives_the_code_book():
    q = _all_words(np.random.default_rng(0))
    out = pd.run_program(pd.IQ4_PROGRAM, q)
    book = np.asarray(tables.KVALUES_IQ4NL, dtype=np.float32)
    assert len(out) == 8
    for i, o in enumerate(out):
        nib = (q >> np.uint32(8 * (i % 4) + (4 if i >= 4 else 0))) & np.uint32(15)
        np.testing.assert_array_equal(o, book[nib])


def test_q8_program_gives_the_signed_bytes():
    h = np.arange(1 << 16, dtype=np.uint32)
    lo, hi = pd.run_program(pd.Q8_PROGRAM, h)
    np.testing.assert_array_equal(lo, (h & 0xFF).astype(np.uint8).view(np.int8).astype(np.float32))
    np.testing.assert_array_equal(hi, (h >> 8).astype(np.uint8).view(np.int8).astype(np.float32))


def test_prmt_sign_mode():
    # a selector nibble with bit 3 set replicates the sign of the byte it names (PTX's default mode)
    a = np.array([0x00800000], dtype=np.uint32)
    b = np.array([0], dtype=np.uint32)
    assert int(pd._prmt(a, b, np.array([0x000A], dtype=np.uint32))[0]) == 0xFF
    assert int(pd._prmt(a, b, np.array([0x0002], dtype=np.uint32))[0]) == 0x80


def test_ptx_text_follows_the_program():
    for prog, n_out in ((pd.IQ4_PROGRAM, 8), (pd.Q8_PROGRAM, 2)):
        text = pd.program_ptx(prog)
        body = [ln for ln in text.splitlines() if ln.endswith(";") and not ln.startswith(".reg")]
        assert len(body) == len(prog) + n_out
        for ins, line in zip(prog, body):
            assert line.startswith(ins[0] + ".")
        assert f"${n_out}" in text and f"${n_out + 1}" not in text
        assert all(f"sub.f32 ${i}," in text for i in range(n_out))
