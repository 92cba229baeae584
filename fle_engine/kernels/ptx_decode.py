"""Byte-permute decoding of 4-bit code-book indices, for the GPU kernels'
fast paths, written once as a short program of 32-bit operations that is
both printed as PTX (for ``tl.inline_asm_elementwise``) and run in numpy
(for tests without a GPU), so that the two cannot drift apart.

The IQ4 code book's 16 values, biased by +128 into unsigned bytes, sit in
four 32-bit words. One ``prmt`` (byte permute) looks up four indices at
once in half of the book (eight bytes), a second in the other half, and a
third picks, per byte, the half that each index's high bit names. A value
becomes a float32 without the conversion unit: its byte is permuted into
the low byte of ``0x4B000000`` (the float 2^23, whose last mantissa bits
are then the byte), and ``2^23 + 128`` is subtracted, which is exact.

Per 32-bit word of eight nibbles (byte j: value j in its low nibble,
value j + 16 in its high nibble, as IQ4_XS and IQ4_NL store them) that is
about twenty integer operations and eight float subtractions for eight
values, where decoding value by value costs about fourteen integer
operations and a conversion each.
"""
from __future__ import annotations

import numpy as np

from fle_quant.quants import tables

__all__ = ["IQ4_PROGRAM", "Q8_PROGRAM", "BOOK_WORDS", "program_ptx", "run_program"]

_M32 = 0xFFFFFFFF


def _book_words() -> list[int]:
    k = (np.asarray(tables.KVALUES_IQ4NL).astype(np.int64) + 128).tolist()
    return [k[4 * i] | k[4 * i + 1] << 8 | k[4 * i + 2] << 16 | k[4 * i + 3] << 24 for i in range(4)]


_T = _book_words()
BOOK_WORDS = tuple(_T)      # the biased code book as four words (also cuda_mv.cu's KV0..KV3)
_MAGIC = 0x4B000000          # the float 2^23
_BIAS = 0x4B000080           # the float 2^23 + 128

# (op, destination, operands...): operands are register names or integers. "q" is the input word;
# o0 .. o7 the outputs (float32 bit patterns before the subtraction of _BIAS).
IQ4_PROGRAM: tuple = (
    ("mov", "t0", _T[0]), ("mov", "t1", _T[1]), ("mov", "t2", _T[2]), ("mov", "t3", _T[3]),
    ("mov", "m", _MAGIC),
    # per byte of the selector: k, or k + 4 (the second operand's byte) where the index's bit 3 is set
    ("and", "lh", "q", 0x88888888), ("shr", "lh", "lh", 1), ("or", "lh", "lh", 0x32103210),
    # nibbles 0..3 of q: low and high nibble of bytes 0 and 1
    ("and", "s", "q", 0x7777),
    ("prmt", "l", "t0", "t1", "s"), ("prmt", "h", "t2", "t3", "s"), ("prmt", "v0", "l", "h", "lh"),
    # nibbles 4..7: bytes 2 and 3
    ("shr", "s", "q", 16), ("and", "s", "s", 0x7777), ("shr", "lh", "lh", 16),
    ("prmt", "l", "t0", "t1", "s"), ("prmt", "h", "t2", "t3", "s"), ("prmt", "v1", "l", "h", "lh"),
    # v0 = values of (lo0, hi0, lo1, hi1), v1 = (lo2, hi2, lo3, hi3): each into 2^23's low byte
    ("prmt", "o0", "v0", "m", 0x7540), ("prmt", "o1", "v0", "m", 0x7542),
    ("prmt", "o2", "v1", "m", 0x7540), ("prmt", "o3", "v1", "m", 0x7542),
    ("prmt", "o4", "v0", "m", 0x7541), ("prmt", "o5", "v0", "m", 0x7543),
    ("prmt", "o6", "v1", "m", 0x7541), ("prmt", "o7", "v1", "m", 0x7543),
)
# output i holds the value of byte j = i % 4 of the word, its low nibble for i < 4, its high one after

# Two int8 values of a 16-bit word (Q8_0's quants, loaded as halfwords): the sign bits flipped (+128),
# each byte into 2^23's low byte; output i is byte i.
Q8_PROGRAM: tuple = (
    ("mov", "m", _MAGIC),
    ("xor", "t", "q", 0x8080),
    ("prmt", "o0", "t", "m", 0x7540), ("prmt", "o1", "t", "m", 0x7541),
)


def _prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """PTX prmt.b32 in its default mode: result byte k is byte (sel >> 4k) & 7 of {b, a}
    (a holds bytes 0..3), sign-replicated where bit 3 of that selector nibble is set."""
    src = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros(np.broadcast(a, b, sel).shape, dtype=np.uint64)
    for k in range(4):
        nib = (sel.astype(np.uint64) >> np.uint64(4 * k)) & np.uint64(0xF)
        byte = (src >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(nib & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        out |= byte << np.uint64(8 * k)
    return out.astype(np.uint32)


def run_program(program, q: np.ndarray) -> list[np.ndarray]:
    """The program on uint32 words ``q`` in numpy: the outputs as float32
    values (the bit patterns minus 2^23 + 128, as the kernel finishes them)."""
    reg = {"q": np.asarray(q, dtype=np.uint32)}

    def val(x):
        return np.uint32(x & _M32) if isinstance(x, int) else reg[x]

    for op, dst, *src in program:
        a = [val(s) for s in src]
        if op == "mov":
            reg[dst] = np.broadcast_to(a[0], reg["q"].shape).astype(np.uint32)
        elif op == "and":
            reg[dst] = a[0] & a[1]
        elif op == "or":
            reg[dst] = a[0] | a[1]
        elif op == "xor":
            reg[dst] = a[0] ^ a[1]
        elif op == "shr":
            reg[dst] = a[0] >> a[1]
        elif op == "prmt":
            reg[dst] = _prmt(*np.broadcast_arrays(a[0], a[1], a[2]))
        else:
            raise ValueError(op)
    n = sum(1 for ins in program if ins[1].startswith("o"))
    bias = np.array(_BIAS, dtype=np.uint32).view(np.float32)
    return [reg[f"o{i}"].view(np.float32) - bias for i in range(n)]


def program_ptx(program) -> str:
    """The program as the body of an inline-asm block: outputs $0 .. $(n-1)
    (float32), then the input word $n."""
    regs = sorted({ins[1] for ins in program if not ins[1].startswith("o")} - {"q"})
    outs = sorted({ins[1] for ins in program if ins[1].startswith("o")})
    lines = ["{", ".reg .b32 " + ", ".join("fq_" + r for r in regs + outs) + ";"]

    def opnd(x):
        if isinstance(x, int):
            return f"0x{x & _M32:08X}"
        if x == "q":
            return f"${len(outs)}"
        return "fq_" + x

    for op, dst, *src in program:
        d = "fq_" + dst
        ty = {"mov": "b32", "and": "b32", "or": "b32", "xor": "b32", "shr": "u32", "prmt": "b32"}[op]
        lines.append(f"{op}.{ty} {d}, " + ", ".join(opnd(s) for s in src) + ";")
    for i, o in enumerate(outs):
        lines.append(f"sub.f32 ${i}, fq_{o}, 0f{_BIAS:08X};")
    lines.append("}")
    return "\n".join(lines)
