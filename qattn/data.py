"""Seeded synthetic attention inputs that imitate properties of real models' Q, K and V.

Every generator returns ``dict(q=..., k=..., v=...)`` of float32 NumPy arrays, BHSD:
q [batch, heads, queries, head_dim], k and v [batch, kv_heads, ctx, head_dim]. The query rows
stand for the last ``queries`` positions of a context of ``ctx`` tokens (the rows of a
prefill's final tile, or a decode step's). ``preset(name, ...)`` picks a generator by name.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

# Channel absmax over the median channel's, measured on the K of a 9B model (DESIGN §3).
OUTLIER_RATIOS = (12.0, 18.5, 26.0, 37.0, 44.0)
# Token-varying spread of those channels, in units of an ordinary channel's standard deviation:
# what smoothing leaves. The largest stays under ~4× the median channel's absmax (4.4 at worst over
# 3600 draws of 256–4096 keys).
OUTLIER_SPREADS = (1.2, 1.6, 2.0, 2.4, 2.8)
# Channel absmax over the median channel's of the outliers_scale preset's five zero-mean channels: the
# 50–200× scale-type outliers (sign varying by token) that K smoothing cannot touch.
SCALE_OUTLIER_RATIOS = (50.0, 80.0, 110.0, 150.0, 200.0)
# Absmax of rope_massive's rotating channel pair over the median channel's.
MASSIVE_RATIO = 50.0
# Score of the diffuse preset's heavy keys above its tail (natural log), calibrated so that
# ~10% (4K) and ~40% (32K) of a row's mass lies below int8's rounding floor.
HEAVY_GAP = 8.5


def _shapes(batch, heads, kv_heads, queries, ctx, head_dim):
    kv_heads = heads if kv_heads is None else kv_heads
    for name, value in (("batch", batch), ("heads", heads), ("kv_heads", kv_heads), ("queries", queries),
                        ("ctx", ctx), ("head_dim", head_dim)):
        if int(value) < 1:
            raise ValueError(f"{name}: expected a positive size, got {value}")
    if heads % kv_heads:
        raise ValueError(f"heads: {heads} is not a multiple of kv_heads {kv_heads}")
    return (batch, heads, queries, head_dim), (batch, kv_heads, ctx, head_dim)


def _normal(rng, shape) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


def _median_channel_absmax(k: np.ndarray, excluded: np.ndarray) -> np.ndarray:
    """Median over channels of the per-channel absmax [B, H, 1, 1]; the excluded channels count
    as the largest (they become the outliers)."""
    absmax = np.abs(k).max(axis=-2)
    absmax[..., excluded] = np.inf
    return np.median(absmax, axis=-1)[..., None, None]


def normal(*, batch=1, heads=1, kv_heads=None, queries=128, ctx=1024, head_dim=128, seed=0):
    """Independent N(0, 1) Q, K, V: the plain baseline of the formats' published error figures."""
    q_shape, kv_shape = _shapes(batch, heads, kv_heads, queries, ctx, head_dim)
    rng = np.random.default_rng(seed)
    return dict(q=_normal(rng, q_shape), k=_normal(rng, kv_shape), v=_normal(rng, kv_shape))


def _outlier_base(name, count, batch, heads, kv_heads, queries, ctx, head_dim, seed):
    """The start of an outlier preset: its generator, N(0, 1) Q, K, V, `count` distinct K channels and
    the median channel absmax of the others."""
    q_shape, kv_shape = _shapes(batch, heads, kv_heads, queries, ctx, head_dim)
    if head_dim < 2 * count:
        raise ValueError(f"head_dim: the {name} preset needs at least {2 * count} channels")
    rng = np.random.default_rng(seed)
    q, k, v = _normal(rng, q_shape), _normal(rng, kv_shape), _normal(rng, kv_shape)
    channels = rng.choice(head_dim, count, replace=False)
    return rng, q, k, v, channels, _median_channel_absmax(k, channels)


def outliers(*, batch=1, heads=1, kv_heads=None, queries=128, ctx=1024, head_dim=128, seed=0):
    """K with five outlier channels whose absmax is 12, 18.5, 26, 37 and 44× the median
    channel's, as measured on a 9B model. Most of each outlier is a per-channel offset shared by
    every token (so K smoothing brings the worst channel down to ≤ ~4×); the rest is a
    token-varying spread of 1.2–2.8× an ordinary channel's. Q and V are N(0, 1)."""
    rng, q, k, v, channels, median = _outlier_base("outliers", len(OUTLIER_RATIOS), batch, heads, kv_heads, queries,
                                                   ctx, head_dim, seed)
    kv_shape = k.shape
    signs = rng.choice(np.array([-1.0, 1.0], np.float32), size=kv_shape[:2] + (1, len(channels)))
    spread = k[..., channels] * np.asarray(OUTLIER_SPREADS, np.float32)
    # Offset o with |o| + max(sign·spread) = ratio·median: the channel's absmax hits the ratio exactly.
    top = (signs * spread).max(axis=-2, keepdims=True)
    offset = np.asarray(OUTLIER_RATIOS, np.float32) * median - top
    k[..., channels] = signs * offset + spread
    return dict(q=q, k=k, v=v)


def _token_varying_outliers(name, ratios, gain_spread, batch, heads, kv_heads, queries, ctx, head_dim, seed):
    """N(0, 1) Q, K, V with len(ratios) zero-mean K channels, each N(0, 1) times a per-token
    log-normal gain exp(gain_spread·N(0, 1)) (none when gain_spread is 0), scaled so that its absmax
    is its ratio times the median channel's."""
    rng, q, k, v, channels, median = _outlier_base(name, len(ratios), batch, heads, kv_heads, queries, ctx, head_dim,
                                                   seed)
    raw = k[..., channels]
    if gain_spread:
        raw = raw * np.exp(np.float32(gain_spread) * rng.standard_normal(k.shape[:3] + (len(channels),),
                                                                         dtype=np.float32))
    k[..., channels] = raw * (np.asarray(ratios, np.float32) * median / np.abs(raw).max(axis=-2, keepdims=True))
    return dict(q=q, k=k, v=v)


def outliers_token(*, batch=1, heads=1, kv_heads=None, queries=128, ctx=1024, head_dim=128, seed=0):
    """K with five zero-mean outlier channels whose scale varies from token to token (a
    log-normal per-token gain), scaled so that their absmax is 12–44× the median channel's.
    The mean is ~0, so K smoothing cannot remove them: the case that per-block and per-thread
    scales exist for. Q and V are N(0, 1)."""
    return _token_varying_outliers("outliers_token", OUTLIER_RATIOS, 1.0, batch, heads, kv_heads, queries, ctx,
                                   head_dim, seed)


def outliers_scale(*, batch=1, heads=1, kv_heads=None, queries=128, ctx=1024, head_dim=128, seed=0):
    """K with five scale-type outlier channels: N(0, 1) times a constant, so that their absmax is
    50, 80, 110, 150 and 200× the median channel's. Their sign varies by token and their mean is ~0,
    so K smoothing leaves them whole; each int8 K scale is set by them and the ordinary channels
    round to a few levels. Q and V are N(0, 1), so these channels dominate the scores: rows are
    peaked (the largest p averages ~0.9 at 4K keys). Q/K channel balancing is made for this case."""
    return _token_varying_outliers("outliers_scale", SCALE_OUTLIER_RATIOS, 0.0, batch, heads, kv_heads, queries,
                                   ctx, head_dim, seed)


def bias(*, batch=1, heads=1, kv_heads=None, queries=128, ctx=1024, head_dim=128, seed=0, ratio=30.0):
    """Qwen-style K: a per-channel bias (one per kv head, from the K projection's bias) whose
    norm is ``ratio`` (default 30) times the typical norm of the token-varying part. The bias
    moves every score of a row by the same q·b, so softmax ignores it, but it eats the
    operand's dynamic range: fp16/int8 K lose precision on the part that matters. Q and V are
    N(0, 1). The bias is a model's: the same for every sequence of the batch, also returned as
    k_bias [kv_heads, head_dim] (what a pre-bias residual K cache is given)."""
    q_shape, kv_shape = _shapes(batch, heads, kv_heads, queries, ctx, head_dim)
    rng = np.random.default_rng(seed)
    q, k, v = _normal(rng, q_shape), _normal(rng, kv_shape), _normal(rng, kv_shape)
    b = _normal(rng, (1, kv_shape[1], 1, head_dim))
    b *= np.float32(ratio * math.sqrt(head_dim)) / np.linalg.norm(b, axis=-1, keepdims=True)
    return dict(q=q, k=k + b, v=v, k_bias=np.ascontiguousarray(b[0, :, 0]))


def _rotate(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """RoPE in the rotate-half layout (GPT-NeoX / Llama): channel i pairs with i + D/2."""
    half = x.shape[-1] // 2
    freq = base ** (-np.arange(half, dtype=np.float64) / half)
    angle = positions[:, None].astype(np.float64) * freq[None, :]
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope(*, batch=1, heads=1, kv_heads=None, queries=128, ctx=1024, head_dim=128, seed=0, base=10000.0):
    """RoPE applied to Q and K at their positions (keys 0..ctx-1, queries the last positions).
    Before rotation Q and K share a per-channel mean that is largest on the slowly rotating
    (low-frequency) pairs, as in trained models; after rotation those pairs carry a
    position-dependent offset, which K smoothing only partly removes, and the scores gain the
    relative-position structure (a recency bias). V is N(0, 1)."""
    q_shape, kv_shape = _shapes(batch, heads, kv_heads, queries, ctx, head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim: RoPE needs an even head_dim, got {head_dim}")
    rng = np.random.default_rng(seed)
    half = head_dim // 2
    weight = np.tile(np.linspace(0.2, 2.5, half, dtype=np.float32), 2)  # low frequencies last in each half
    shared = _normal(rng, (1, kv_shape[1], 1, head_dim)) * weight
    group = q_shape[1] // kv_shape[1]
    q = _normal(rng, q_shape) + np.repeat(shared, group, axis=1)
    k = _normal(rng, kv_shape) + shared
    q = _rotate(q, np.arange(ctx - queries, ctx), base)
    k = _rotate(k, np.arange(ctx), base)
    return dict(q=q.astype(np.float32), k=k.astype(np.float32), v=_normal(rng, kv_shape))


def rope_massive(*, batch=1, heads=1, kv_heads=None, queries=128, ctx=1024, head_dim=128, seed=0, base=10000.0):
    """K with a massive RoPE channel pair: a constant vector per (batch, kv head), rotated by RoPE at
    each key's position on the slowest pair (channels D/2 − 1 and D − 1 in the rotate-half layout),
    where trained models keep their massive Q/K values; it is scaled so that the pair's larger
    channel peaks at MASSIVE_RATIO (50) times the median channel's absmax. The pair turns once
    every ~54K positions at D = 128: over a short context it is an offset that K smoothing removes,
    over a long one (32K) an arc whose ends smoothing cannot bring in, a scale-type outlier. Q, V
    and the rest of K are N(0, 1) (isotropic, so rotating them changes nothing in distribution)."""
    q_shape, kv_shape = _shapes(batch, heads, kv_heads, queries, ctx, head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim: RoPE needs an even head_dim, got {head_dim}")
    rng = np.random.default_rng(seed)
    q, k, v = _normal(rng, q_shape), _normal(rng, kv_shape), _normal(rng, kv_shape)
    half = head_dim // 2
    pair = np.array([half - 1, head_dim - 1])
    massive = np.zeros(kv_shape[:2] + (1, head_dim), np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=kv_shape[:2] + (1,))
    massive[..., pair] = np.stack([np.cos(phase), np.sin(phase)], axis=-1)
    rotated = _rotate(massive, np.arange(ctx), base)[..., pair]  # [B, Hkv, ctx, 2]
    peak = np.abs(rotated).max(axis=(-2, -1), keepdims=True)
    k[..., pair] += rotated * (np.float32(MASSIVE_RATIO) * _median_channel_absmax(k, pair) / peak)
    return dict(q=q, k=k, v=v)


def bias_rope(*, batch=1, heads=1, kv_heads=None, queries=128, ctx=1024, head_dim=128, seed=0, ratio=30.0,
              base=10000.0):
    """Qwen-style K with RoPE: the bias preset's large per-channel K bias (norm ``ratio`` times the
    token-varying part's) added before RoPE, then K rotated at its positions 0..ctx-1 and Q (N(0, 1))
    at the last ``queries`` positions, in the rotate-half layout with base ``base``. After RoPE the bias
    turns with the position, so it no longer moves every score of a row alike: it sets each token's 8-bit
    scale and varies from key to key. Also returns k_bias [kv_heads, head_dim] (the bias before RoPE),
    rope_theta (the base) and k_pre (K before RoPE, what a pre-RoPE cache is written with)."""
    if head_dim % 2:
        raise ValueError(f"head_dim: RoPE needs an even head_dim, got {head_dim}")
    x = bias(batch=batch, heads=heads, kv_heads=kv_heads, queries=queries, ctx=ctx, head_dim=head_dim, seed=seed,
             ratio=ratio)
    return dict(q=_rotate(x["q"], np.arange(ctx - queries, ctx), base).astype(np.float32),
                k=_rotate(x["k"], np.arange(ctx), base).astype(np.float32), v=x["v"], k_bias=x["k_bias"],
                rope_theta=np.float32(base), k_pre=x["k"])


def _heavy_positions(rng, ctx: int, count: int) -> np.ndarray:
    """A sink at 0, the last 4 tokens and random ones between: count distinct key positions."""
    fixed = np.unique(np.r_[0, np.arange(max(0, ctx - 4), ctx)])
    middle = np.setdiff1d(np.arange(ctx), fixed)
    extra = rng.choice(middle, size=min(len(middle), max(0, count - len(fixed))), replace=False)
    return np.concatenate([fixed, extra])[:count]


def diffuse(*, batch=1, heads=1, kv_heads=None, queries=128, ctx=4096, head_dim=128, seed=0, heavy=16):
    """Long-context rows whose probability mass spreads as the context grows. A fixed set of
    ``heavy`` keys (an attention sink at position 0, the last few tokens, a few retrieved ones)
    aligns with a direction each query leans on; every other key is N(0, 1) and scores with a
    spread of ~1. The heavy keys' weight does not grow with the context while the diffuse
    tail's does, so at 4K a row keeps ~10% of its mass in probabilities below int8's rounding
    floor (0.5/127) and at 32K ~40%, the figure measured on a real long-context row. V carries a
    per-channel mean, as real V does, so dropping the tail biases the output."""
    q_shape, kv_shape = _shapes(batch, heads, kv_heads, queries, ctx, head_dim)
    rng = np.random.default_rng(seed)
    group = q_shape[1] // kv_shape[1]
    direction = _normal(rng, kv_shape[:2] + (1, head_dim))
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    k = _normal(rng, kv_shape)
    positions = _heavy_positions(rng, ctx, heavy)
    # A query leans 0.75 of its norm on the direction, so a heavy key scores ~8.5 (natural log)
    # above the tail's mean of 0: 16 of them outweigh a 32K-key tail (32768·e^0.5) ~1.5 : 1.
    heavy_norm = np.float32(HEAVY_GAP / 0.75)
    k[..., positions, :] = 0.5 * k[..., positions, :] + heavy_norm * direction
    lean = rng.uniform(0.65, 0.85, size=q_shape[:3] + (1,)).astype(np.float32) * np.float32(math.sqrt(head_dim))
    q = _normal(rng, q_shape) * np.float32(math.sqrt(1 - 0.75 ** 2)) + lean * np.repeat(direction, group, axis=1)
    v = _normal(rng, kv_shape) + _normal(rng, kv_shape[:2] + (1, head_dim))
    return dict(q=q.astype(np.float32), k=k, v=v)


PRESETS: dict[str, Callable[..., dict]] = {
    "normal": normal,
    "outliers": outliers,
    "outliers_token": outliers_token,
    "outliers_scale": outliers_scale,
    "bias": bias,
    "rope": rope,
    "rope_massive": rope_massive,
    "bias_rope": bias_rope,
    "diffuse": diffuse,
}


def preset(name: str, *, ctx: int, queries: int = 128, batch: int = 1, heads: int = 1, kv_heads: int | None = None,
           head_dim: int = 128, seed: int = 0) -> dict:
    """Generate the named preset: dict(q, k, v) of float32 BHSD arrays (see each generator; bias
    also gives its k_bias, bias_rope its k_bias, rope_theta and k_pre)."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name](batch=batch, heads=heads, kv_heads=kv_heads, queries=queries, ctx=ctx, head_dim=head_dim,
                         seed=seed)
