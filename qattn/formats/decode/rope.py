"""Rotary position embedding (RoPE) as the pre-bias residual K uses it under RoPE (DESIGN §2): a model whose K
projection adds a large bias b before RoPE has keys k = R_p (k_pre) whose bias part R_p b rotates with the
position p. Post-RoPE layout: the cache stores k - R_p b (quantized) and the decode kernel adds q·R_p b back
per key. Pre-RoPE layout: the cache stores k_pre - b and the kernel turns each key's codes by R_p on chip
(rotated_codes) and adds q·R_p b. Writer, kernel and references use the same map R_p, so the scores are exact
by construction whatever rounding R_p carries.

R_p here: the first rotary_dim channels form rotary_dim / 2 pairs (a_i, b_i), (i, i + rotary_dim / 2) in the
"neox" (rotate-half) layout or (2i, 2i + 1) in "gptj"; pair i turns by the angle φ_i(p) = fl32(fl32(p) θ_i),
θ_i = fl32(theta^(-2i / rotary_dim)) (computed in fp64): the fp32 angle HF-style RoPE computes. Its cosine and
sine, computed in fp64, are rounded to fp16: the table [max_positions, rotary_dim] holds cos φ_i(p), sin φ_i(p)
at 2i, 2i + 1 of row p, and R_p is the rotation with those fp16 values (a linear map a few 2^-12 from a
rotation). The other channels keep b as it is. Key j of a sequence is at position j: its index in the
sequence, as the block table orders its pages.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

STYLES = ("neox", "gptj")


@dataclass(frozen=True)
class RoPE:
    """RoPE of a model's keys: base theta, the rotary_dim leading channels (None: all of head_dim) paired in
    style "neox" or "gptj", positions 0 .. max_positions - 1 (None: the cache's capacity, pages x page size;
    the table takes max_positions x rotary_dim x 2 bytes)."""

    theta: float = 10000.0
    rotary_dim: int | None = None
    style: str = "neox"
    max_positions: int | None = None

    def resolved(self, head_dim: int, capacity: int) -> "RoPE":
        """This RoPE with rotary_dim and max_positions filled in for a cache, checked (a ValueError names the
        field)."""
        if not isinstance(self.theta, (int, float)) or not np.isfinite(self.theta) or self.theta <= 1:
            raise ValueError(f"rope: theta must be a finite number above 1, got {self.theta!r}")
        if self.style not in STYLES:
            raise ValueError(f"rope: style must be one of {', '.join(STYLES)}, got {self.style!r}")
        dim = head_dim if self.rotary_dim is None else self.rotary_dim
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or not 16 <= dim <= head_dim or dim % 16:
            raise ValueError(f"rope: rotary_dim must be a multiple of 16 from 16 to head_dim {head_dim}, got {dim!r}")
        most = capacity if self.max_positions is None else self.max_positions
        if isinstance(most, bool) or not isinstance(most, (int, np.integer)) or not 1 <= most < 2 ** 24:
            raise ValueError(f"rope: max_positions must be an integer from 1 to 2^24 - 1, got {most!r}")
        return replace(self, theta=float(self.theta), rotary_dim=int(dim), max_positions=int(most))

    @property
    def gptj(self) -> bool:
        return self.style == "gptj"

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The channels (a_i, b_i) of each pair i < rotary_dim / 2."""
        i = np.arange(self.rotary_dim // 2)
        return (2 * i, 2 * i + 1) if self.gptj else (i, i + self.rotary_dim // 2)

    def frequencies(self) -> np.ndarray:
        """θ_i = fl32(theta^(-2i / rotary_dim)), i < rotary_dim / 2."""
        return (self.theta ** (-2.0 * np.arange(self.rotary_dim // 2) / self.rotary_dim)).astype(np.float32)

    def table(self) -> np.ndarray:
        """fp16 [max_positions, rotary_dim]: cos φ_i(p) at 2i and sin φ_i(p) at 2i + 1 of row p."""
        angle = (np.arange(self.max_positions, dtype=np.float32)[:, None] * self.frequencies()[None]).astype(np.float32)
        table = np.empty((self.max_positions, self.rotary_dim), np.float16)
        table[:, 0::2] = np.cos(angle.astype(np.float64)).astype(np.float16)
        table[:, 1::2] = np.sin(angle.astype(np.float64)).astype(np.float16)
        return table


def rotated_bias(bias, rope: RoPE, table, positions, xp=np):
    """R_p b in fp32 as the cache writer computes it, for bias [H, D] at positions [T] (clamped to the table):
    [T, H, D]; pair (a, b) with the table's c = cos, s = sin: fl(fl(b_a c) - fl(b_b s)) at a and
    fl(fl(b_a s) + fl(b_b c)) at b; the other channels b. xp: NumPy or CuPy (the same bits)."""
    f32 = xp.float32
    bias = xp.asarray(bias, f32)
    rows = xp.asarray(table)[xp.clip(xp.asarray(positions).astype(xp.int64), 0, rope.max_positions - 1)].astype(f32)
    cos, sin = rows[:, None, 0::2], rows[:, None, 1::2]  # [T, 1, R/2]
    first, second = (xp.asarray(p) for p in rope.pairs())
    out = xp.broadcast_to(bias, (rows.shape[0],) + bias.shape).copy()
    ba, bb = bias[None, :, first], bias[None, :, second]
    out[..., first] = (ba * cos).astype(f32) - (bb * sin).astype(f32)
    out[..., second] = (ba * sin).astype(f32) + (bb * cos).astype(f32)
    return out.astype(f32)


def rotate_exact(x: np.ndarray, rope: RoPE, table: np.ndarray) -> np.ndarray:
    """R_p x in fp64 (the table's values, exactly) for x [H, L, D] at the positions 0 .. L - 1."""
    x = np.asarray(x, np.float64)
    rows = table[np.minimum(np.arange(x.shape[1]), rope.max_positions - 1)].astype(np.float64)
    cos, sin = rows[None, :, 0::2], rows[None, :, 1::2]
    first, second = rope.pairs()
    out = x.copy()
    xa, xb = x[..., first], x[..., second]
    out[..., first] = xa * cos - xb * sin
    out[..., second] = xa * sin + xb * cos
    return out


def rotated_bias_exact(bias: np.ndarray, rope: RoPE, table: np.ndarray, length: int) -> np.ndarray:
    """R_p b in fp64 for the keys 0 .. length - 1 of a sequence: [H, length, D]."""
    bias = np.asarray(bias, np.float64)
    return rotate_exact(np.broadcast_to(bias[:, None], (bias.shape[0], length, bias.shape[1])), rope, table)


def rotated_codes(codes: np.ndarray, rope: RoPE, table: np.ndarray, half) -> np.ndarray:
    """A pre-RoPE cache's K codes [H, L, D] (their values) turned on chip as the decode kernel does, key j at
    position j: each pair (a, z) -> fl(fl(c_a C) - fl(c_z S)), fl(fl(c_a S) + fl(c_z C)) in fp32 with the
    table's fp16 cos C and sin S, rounded to the query's 16-bit type `half` (the non-rotary channels as they
    are); returned as float32 values."""
    f32 = np.float32
    codes = np.asarray(codes, f32)
    rows = table[np.minimum(np.arange(codes.shape[1]), rope.max_positions - 1)].astype(f32)
    cos, sin = rows[None, :, 0::2], rows[None, :, 1::2]
    first, second = rope.pairs()
    out = codes.copy()
    ca, cz = codes[..., first], codes[..., second]
    out[..., first] = ((ca * cos).astype(f32) - (cz * sin).astype(f32)).astype(half)
    out[..., second] = ((ca * sin).astype(f32) + (cz * cos).astype(f32)).astype(half)
    return out.astype(f32)


def constant_bias(bias: np.ndarray, rope: RoPE) -> np.ndarray:
    """b with its rotary channels zeroed: the part whose q·b is one constant per query row."""
    out = np.array(bias, np.float32)
    out[..., :rope.rotary_dim] = 0
    return out


def score_terms(q: np.ndarray, bias: np.ndarray, rope: RoPE, scale_log2: np.float32) -> np.ndarray:
    """The decode kernel's B operand of the q·R_p b product for query rows q [R, D] (fp32 values of the 16-bit
    query) and one kv head's bias [D]: u_i = fl(fl(fl(q_a b_a) + fl(q_b b_b)) x scale_log2) at 2i and
    w_i = fl(fl(fl(q_b b_a) - fl(q_a b_b)) x scale_log2) at 2i + 1, each the sum of its fp16 hi and lo parts
    (hi = fp16(x), lo = fp16(x - hi)): [R, rotary_dim] fp64. Dotted with table row p it is q·R_p b·τ·log2 e
    less the constant part."""
    f32 = np.float32
    q, bias = np.asarray(q, f32), np.asarray(bias, f32)
    first, second = rope.pairs()
    qa, qb, ba, bb = q[:, first], q[:, second], bias[first], bias[second]
    u = (((qa * ba).astype(f32) + (qb * bb).astype(f32)).astype(f32) * scale_log2).astype(f32)
    w = (((qb * ba).astype(f32) - (qa * bb).astype(f32)).astype(f32) * scale_log2).astype(f32)
    terms = np.empty((q.shape[0], rope.rotary_dim), np.float64)
    for k, x in ((0, u), (1, w)):
        hi = x.astype(np.float16)
        lo = (x - hi.astype(f32)).astype(f32).astype(np.float16)
        terms[:, k::2] = hi.astype(np.float64) + lo.astype(np.float64)
    return terms
