"""The decode cache on the host: its quantizer in NumPy, exactly as the GPU writer computes it, and a
paged cache in natural layout that the emulator reads (DESIGN §2). An 8-bit
side takes one fp32 scale per (token, kv head), s = max|x| / QMAX (127 for i8, 448 for e4m3), or a
given scale per kv head, and codes rint(x / s) clamped to ±127 or e4m3(x / s) (RNE, saturating; an
Inf value under a head scale codes NaN); a 16-bit side is stored as given. A NaN or Inf in a token row makes its scale non-finite (int8 has no
NaN code), so the token dequantizes to non-finite values, as the kernel reads it.

An 8-bit K may keep page means (k_mean "page", PageMeans): K - μ_page is stored, μ_page an int8 record
(codes, one scale) per (page, kv head) fixed when the page is started, from a running mean kept in
fixed point so that the GPU's atomics and this model sum to the same bits.

An 8-bit K may be balanced per channel (k_balance): one α per (kv head, channel), and (K - b - μ_page)
times fl(1/α) stored, so that a scale-type outlier channel no longer sets every token's scale; the
decode kernel multiplies q by α (exact in real arithmetic: q·k = Σ (q_c α_c)(k_c / α_c)). Calibrated α
(balance_factors) are powers of two, so both products are exact.

With RoPE (a post-RoPE pre-bias residual K, rope.py) the bias part of a key at position p is R_p b:
K - R_p b is stored, R_p b as the writer computes it in fp32 (rope.rotated_bias).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ...check.quant import E4M3, E4M3_MAX, INT8_MAX, to_e4m3
from ...engine.arrays import numpy_dtype
from .rope import RoPE, rotate_exact, rotated_bias, rotated_bias_exact

BIAS_LAYOUTS = ("post-rope", "pre-rope")  # the pre-bias residual K under RoPE: post-RoPE or pre-RoPE keys

QMAX = {"e4m3": E4M3_MAX, "i8": float(INT8_MAX)}
CODE_DTYPES = {"e4m3": E4M3, "i8": np.int8}


class TokenCodes(NamedTuple):
    """Codes of token rows [..., D] (int8 or float8_e4m3fn) and their scales ([...] for token scales)."""

    codes: np.ndarray
    scale: np.ndarray

    def dequantize(self) -> np.ndarray:
        scale = np.asarray(self.scale, np.float64)
        return self.codes.astype(np.float64) * (scale[..., None] if scale.ndim else scale)


def token_scales(x: np.ndarray, code: str) -> np.ndarray:
    """One fp32 scale per row of x [..., D]: max|x| / QMAX (NaN if the row holds one)."""
    absmax = np.abs(np.asarray(x, np.float32)).max(axis=-1)
    return (absmax / np.float32(QMAX[code])).astype(np.float32)


def head_scales(x: np.ndarray, code: str) -> np.ndarray:
    """One fp32 scale per kv head from x [T, Hkv, D] (a calibration write): max over tokens and channels."""
    absmax = np.abs(np.asarray(x, np.float32)).max(axis=(0, 2))
    scale = (absmax / np.float32(QMAX[code])).astype(np.float32)
    return np.where(scale > 0, scale, np.float32(1))  # an all-zero head keeps a usable scale


def quantize_tokens(x: np.ndarray, code: str, scale: np.ndarray | None = None) -> TokenCodes:
    """Rows x [..., D] as the writer stores them: with scale None, token scales; else scale broadcast
    against x's leading axes (e.g. [Hkv] per kv head for x [T, Hkv, D])."""
    if code not in QMAX:
        raise ValueError(f"code: expected one of {', '.join(QMAX)}, got {code!r}")
    x = np.asarray(x, np.float32)
    if scale is None:
        s = token_scales(x, code)
    else:  # one scale per kv head: x [T, Hkv, D] against scale [Hkv]
        s = np.broadcast_to(np.asarray(scale, np.float32), x.shape[:-1])
    safe = np.where(s > 0, s, np.float32(1))[..., None]  # NaN > 0 is False: a NaN scale divides by 1
    y = (x / safe).astype(np.float32)
    if code == "e4m3":
        codes = to_e4m3(y)  # a quotient beyond the range saturates
        if scale is not None:  # an Inf value codes NaN under a head scale (a token's own scale is NaN already)
            codes[np.isinf(x)] = np.nan
    else:  # fmax/fmin take the number over a NaN, as the kernel's fmaxf/fminf
        codes = np.rint(np.fmin(np.fmax(y, np.float32(-INT8_MAX)), np.float32(INT8_MAX))).astype(np.int8)
    return TokenCodes(codes, np.array(s, np.float32))


BALANCE_MIN = 2.0  # a calibrated α below this is 1: the channel is left as it is


def balance_factors(x, xp=np):
    """α [H, D] from a calibration write's K residual x [T, H, D]: with m_c the column absmax of channel c
    (non-finite values left out) and m̃ the median over the head's channels, α_c = 2^round(log2 sqrt(m_c / m̃))
    where that is at least BALANCE_MIN, else 1 (powers of two: q·α and K / α add no rounding)."""
    x = xp.asarray(x, xp.float32)
    if x.shape[0] == 0:
        return xp.ones(x.shape[1:], xp.float32)
    absmax = xp.where(xp.isfinite(x), xp.abs(x), xp.float32(0)).max(axis=0).astype(xp.float64)
    median = xp.median(absmax, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = absmax / xp.where(median > 0, median, 1.0)
        alpha = xp.exp2(xp.rint(0.5 * xp.log2(xp.where(ratio > 0, ratio, 1.0))))
    return xp.where((median > 0) & (alpha >= BALANCE_MIN), alpha, 1.0).astype(xp.float32)


def checked_balance(given, kv_heads: int, head_dim: int) -> np.ndarray:
    """k_balance as given to a cache: None, "calibrate" (returned as they are) or α, positive finite values
    [kv_heads, head_dim] (a host array, returned as fp32); else a ValueError naming k_balance."""
    if given is None or (isinstance(given, str) and given == "calibrate"):
        return given
    alpha = None if isinstance(given, str) else np.asarray(given, np.float32)
    if alpha is None or alpha.shape != (kv_heads, head_dim) or not np.all(np.isfinite(alpha) & (alpha > 0)):
        got = repr(given) if alpha is None else f"shape {alpha.shape}" + (
            "" if alpha.shape != (kv_heads, head_dim) else " with values not positive and finite")
        raise ValueError(f"k_balance: expected None, 'calibrate' or positive finite values [kv_heads, head_dim] = "
                         f"[{kv_heads}, {head_dim}], got {got}")
    return alpha


def checked_layout(layout: str, rope, k_mean: str, k_balance) -> None:
    """k_bias_layout: one of BIAS_LAYOUTS; pre-RoPE keys need a rope and take neither page means nor balancing
    (they act on channels that R_p mixes); else a ValueError naming the argument."""
    if layout not in BIAS_LAYOUTS:
        raise ValueError(f"k_bias_layout: expected one of {', '.join(map(repr, BIAS_LAYOUTS))}, got {layout!r}")
    if layout == "pre-rope":
        if rope is None:
            raise ValueError("k_bias_layout: 'pre-rope' keys are turned by the cache's RoPE: give rope=qattn.RoPE(...)")
        if k_mean != "off" or k_balance is not None:
            raise ValueError("k_bias_layout: 'pre-rope' keys take neither k_mean nor k_balance (R_p mixes the channels "
                             "they act on); the post-RoPE layout takes both")


def balance_inverse(alpha, xp=np):
    """fl(1/α) in fp32: what the writer multiplies K's residual by (exact for powers of two)."""
    return (xp.float32(1) / xp.asarray(alpha, xp.float32)).astype(xp.float32)


MEAN_UNIT, MEAN_CLAMP = 2.0 ** 16, 2.0 ** 24  # the running sums' fixed point (the writer's MEAN_UNIT, MEAN_CLAMP)


def mean_terms(x, xp=np):
    """Running-sum terms of float32 values x: rint(clamp(x, ±2^24) * 2^16) as int64 (exact scaling)."""
    clamped = xp.clip(xp.asarray(x, xp.float32), xp.float32(-MEAN_CLAMP), xp.float32(MEAN_CLAMP))
    return xp.rint(clamped * xp.float32(MEAN_UNIT)).astype(xp.int64)


def mean_record(sums, counts, xp=np):
    """The int8 mean record of running sums [H, D] (int64) over counts [H] tokens: the mean
    float32(sum * 2^-16) / float32(count) in fp32 (zero without tokens) as codes [H, D] int8 with one
    scale [H] each, s = max|mean| / 127, as a token's own scale."""
    counts = xp.asarray(counts, xp.int64)[:, None]
    mean = (sums.astype(xp.float64) * 2.0 ** -16).astype(xp.float32) / xp.maximum(counts, 1).astype(xp.float32)
    mean = xp.where(counts > 0, mean, xp.float32(0)).astype(xp.float32)
    scale = (xp.abs(mean).max(axis=-1) / xp.float32(INT8_MAX)).astype(xp.float32)
    safe = xp.where(scale > 0, scale, xp.float32(1))
    y = (mean / safe[:, None]).astype(xp.float32)
    return xp.rint(xp.clip(y, xp.float32(-INT8_MAX), xp.float32(INT8_MAX))).astype(xp.int8), scale


def mean_values(codes, scale, xp=np):
    """A record's values fl(code * scale) in float32 (what the writer subtracts and the kernel adds)."""
    return (xp.asarray(codes).astype(xp.float32) * xp.asarray(scale, xp.float32)[..., None]).astype(xp.float32)


def page_starts(slots: np.ndarray, page_size: int) -> np.ndarray:
    """Which tokens of a write [T] store into a page this write starts: the page's offset 0 is the write's
    token `offset` places before (as a slot mapping gives a sequence's tokens in order)."""
    slots = np.asarray(slots, np.int64)
    offsets = np.where(slots >= 0, slots % page_size, 0)
    first = np.arange(slots.size) - offsets
    return (slots >= 0) & (first >= 0) & (slots[np.maximum(first, 0)] == slots - offsets)


@dataclass
class PageMeans:
    """The page means of an 8-bit K: int8 records codes [pages + 1, H, D] and scales [pages + 1, H], the
    last one the snapshot of the running mean (what a page started by the next write takes), and the
    running sums [H, D] (int64, fixed point) and token counts [H] of every finite K - b row written."""

    codes: np.ndarray
    scale: np.ndarray
    sums: np.ndarray
    counts: np.ndarray
    seeded: bool = False

    @classmethod
    def empty(cls, num_pages: int, kv_heads: int, head_dim: int) -> "PageMeans":
        return cls(np.zeros((num_pages + 1, kv_heads, head_dim), np.int8), np.zeros((num_pages + 1, kv_heads), np.float32),
                   np.zeros((kv_heads, head_dim), np.int64), np.zeros(kv_heads, np.int64))

    @property
    def snapshot(self) -> np.ndarray:
        return mean_values(self.codes[-1], self.scale[-1])

    @staticmethod
    def _counted(x: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """[T, H]: the rows that enter the running mean (stored, finite)."""
        return (np.asarray(slots)[:, None] >= 0) & np.isfinite(x).all(axis=-1)

    def seed(self, x: np.ndarray, slots: np.ndarray) -> None:
        """A fresh cache's first write x [T, H, D] (K - b, float32) sets the snapshot to its own mean."""
        keep = self._counted(x, slots)
        sums = (mean_terms(x) * keep[..., None]).sum(axis=0)
        self.codes[-1], self.scale[-1] = mean_record(sums, keep.sum(axis=0))
        self.seeded = True

    def write(self, x: np.ndarray, slots: np.ndarray, page_size: int) -> np.ndarray:
        """The μ [T, H, D] each token of a write x [T, H, D] (K - b, float32) at slots [T] is stored against,
        as the writer takes it (a fresh cache is seeded first): the snapshot where the write starts the token's
        page, else the page's record;
        then the records of the pages started (offset 0) take the snapshot, the rows are added to the running
        sums, and the snapshot becomes their mean."""
        slots = np.asarray(slots, np.int64)
        stored = slots >= 0
        pages = np.where(stored, slots // page_size, 0)
        record = np.where(page_starts(slots, page_size), self.codes.shape[0] - 1, pages)
        mu = mean_values(self.codes[record], self.scale[record])
        started = pages[stored & (slots % page_size == 0)]
        self.codes[started], self.scale[started] = self.codes[-1], self.scale[-1]
        keep = self._counted(x, slots)
        self.sums += (mean_terms(x) * keep[..., None]).sum(axis=0)
        self.counts += keep.sum(axis=0)
        self.codes[-1], self.scale[-1] = mean_record(self.sums, self.counts)
        return mu

    def gather(self, table_row: np.ndarray, length: int, page_size: int) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's per-key records: codes [H, length, D] (float32) and scales [H, length]."""
        pages = np.asarray(table_row, np.int64)[np.arange(length) // page_size]
        return self.codes[pages].transpose(1, 0, 2).astype(np.float32), self.scale[pages].T


@dataclass
class HostPagedCache:
    """A paged K-V cache on the host in natural layout: k, v [pages, kv heads, page_size, D] float32
    holding each token's stored values (8-bit codes as their exact values, or the 16-bit values);
    k_scale, v_scale [pages, kv heads, page_size] (token scales), [kv heads] (head scales) or None (a
    16-bit side); k_bias [kv heads, D] fp32 or None (a pre-bias residual K stores K - b); k_mean, the
    page means of an 8-bit K or None (K - b - μ_page stored); k_balance, an 8-bit K's α [kv heads, D]
    fp32, "calibrate" (set by the first write) or None ((K - b - μ_page) x fl(1/α) stored); rope, the
    resolved RoPE with its fp16 table, or None, and k_bias_layout: "post-rope" (post-RoPE keys: K - R_p b
    stored, p the token's position) or "pre-rope" (pre-RoPE keys: k_pre - b stored). A token's value is stored
    value x scale (x α + k_bias (R_p k_bias post-RoPE) + μ_page for K; pre-RoPE: R_p (stored x scale + b))."""

    fmt: str
    page_size: int
    k: np.ndarray
    v: np.ndarray
    k_scale: np.ndarray | None
    v_scale: np.ndarray | None
    k_bias: np.ndarray | None = None
    k_mean: PageMeans | None = None
    k_balance: np.ndarray | str | None = None
    rope: RoPE | None = None
    rope_table: np.ndarray | None = None
    k_bias_layout: str = "post-rope"

    @property
    def pre_rope(self) -> bool:
        return self.rope is not None and self.k_bias_layout == "pre-rope"

    @property
    def alpha(self) -> np.ndarray | None:
        """K's balancing α [kv heads, D] fp32, or None (no balancing, or "calibrate" before a write)."""
        return self.k_balance if isinstance(self.k_balance, np.ndarray) else None

    @classmethod
    def empty(cls, fmt: str, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
              scale: str = "token", k_scale=None, v_scale=None, k_bias=None, k_mean: str = "off",
              k_balance=None, rope: RoPE | None = None, k_bias_layout: str = "post-rope") -> "HostPagedCache":
        sides = fmt.split("-")
        shape = (num_pages, kv_heads, page_size, head_dim)

        def side_scale(code, given):
            if code not in QMAX:
                return None
            if scale == "head":
                return None if given is None else np.asarray(given, np.float32).reshape(kv_heads)
            return np.zeros(shape[:3], np.float32)

        if rope is not None:
            if k_bias is None or sides[0] not in QMAX:
                raise ValueError(f"rope: the residual K under RoPE is for an 8-bit K with a k_bias (the K bias added "
                                 f"before RoPE); got {fmt} with k_bias {'given' if k_bias is not None else 'None'}")
            rope = rope.resolved(head_dim, num_pages * page_size)
        checked_layout(k_bias_layout, rope, k_mean, k_balance)
        return cls(fmt, page_size, np.zeros(shape, np.float32), np.zeros(shape, np.float32),
                   side_scale(sides[0], k_scale), side_scale(sides[1], v_scale),
                   None if k_bias is None else np.asarray(k_bias, np.float32).reshape(kv_heads, head_dim),
                   PageMeans.empty(num_pages, kv_heads, head_dim) if k_mean == "page" else None,
                   checked_balance(k_balance, kv_heads, head_dim), rope, None if rope is None else rope.table(),
                   k_bias_layout)

    def write(self, k: np.ndarray, v: np.ndarray, slots: np.ndarray, *, scale: str = "token",
              positions: np.ndarray | None = None) -> None:
        """Store new tokens k, v [T, kv heads, D] at slots [T] (page * page_size + offset; negative:
        skipped), quantized as the GPU writer does; with rope, at positions [T] (each token's index in its
        sequence). Head scales not yet set are calibrated from k, v."""
        if (positions is None) != (self.rope is None or self.pre_rope):
            raise ValueError("positions: expected the tokens' positions [T] with post-RoPE keys, and none otherwise")
        slots = np.asarray(slots).astype(np.int64)
        keep = slots >= 0
        pages, offsets = slots[keep] // self.page_size, slots[keep] % self.page_size
        for name, x, code in (("k", k, self.fmt.split("-")[0]), ("v", v, self.fmt.split("-")[1])):
            x = np.asarray(x, np.float32)
            if name == "k" and self.k_bias is not None:
                bias = self.k_bias[None] if self.rope is None or self.pre_rope else rotated_bias(
                    self.k_bias, self.rope, self.rope_table, positions)
                x = (x - bias).astype(np.float32)
            calibration = x[keep]  # what head scales not given are calibrated on
            if name == "k" and self.k_mean is not None:
                if not self.k_mean.seeded:
                    self.k_mean.seed(x, slots)
                calibration = (calibration - self.k_mean.snapshot[None]).astype(np.float32)
                x = (x - self.k_mean.write(x, slots, self.page_size)).astype(np.float32)
            if name == "k" and self.k_balance is not None:
                if isinstance(self.k_balance, str):
                    self.k_balance = balance_factors(calibration)
                inverse = balance_inverse(self.k_balance)[None]
                calibration, x = ((y * inverse).astype(np.float32) for y in (calibration, x))
            x = x[keep]
            store = getattr(self, name)
            if code not in QMAX:  # rounded to the 16-bit type, as the writer stores it
                half = np.dtype(np.float16) if code == "f16" else numpy_dtype("bfloat16")
                store[pages, :, offsets] = x.astype(half).astype(np.float32)
                continue
            if scale == "head":
                if getattr(self, f"{name}_scale") is None:
                    setattr(self, f"{name}_scale", head_scales(calibration, code))
                q = quantize_tokens(x, code, getattr(self, f"{name}_scale"))
            else:
                q = quantize_tokens(x, code)
                getattr(self, f"{name}_scale")[pages, :, offsets] = q.scale
            store[pages, :, offsets] = q.codes.astype(np.float32)

    def gather(self, name: str, table_row: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """One sequence's stored values [kv heads, length, D] and its scales ([kv heads, length],
        [kv heads] or None) of side name ("k" or "v")."""
        keys = np.arange(length)
        pages = np.asarray(table_row, np.int64)[keys // self.page_size]
        offsets = keys % self.page_size
        values = getattr(self, name)[pages, :, offsets].transpose(1, 0, 2)
        scale = getattr(self, f"{name}_scale")
        if scale is not None and scale.ndim == 3:
            scale = scale[pages, :, offsets].T
        return values, scale

    def dequantize(self, name: str, table_row: np.ndarray, length: int) -> np.ndarray:
        """One sequence's side as float64 [kv heads, length, D]: stored value x scale (for K: x α, + the K
        bias and the page means), exactly."""
        values, scale = self.gather(name, table_row, length)
        values = values.astype(np.float64)
        if scale is not None:
            scale = np.asarray(scale, np.float64)
            values = values * (scale[:, :, None] if scale.ndim == 2 else scale[:, None, None])
        if name == "k" and self.alpha is not None:
            values = values * self.alpha[:, None, :].astype(np.float64)
        if name == "k" and self.pre_rope:
            return rotate_exact(values + self.k_bias[:, None, :].astype(np.float64), self.rope, self.rope_table)
        if name == "k" and self.k_bias is not None:
            values = values + (self.k_bias[:, None, :].astype(np.float64) if self.rope is None else
                               rotated_bias_exact(self.k_bias, self.rope, self.rope_table, length))
        if name == "k" and self.k_mean is not None:
            codes, scale = self.k_mean.gather(table_row, length, self.page_size)
            values = values + mean_values(codes, scale).astype(np.float64)
        return values
