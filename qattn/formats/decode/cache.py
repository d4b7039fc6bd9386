"""A paged K-V cache on the GPU (DESIGN §2 "FP8/INT8 KV-cache decode") and its one-launch writer.

K and V are each stored 16-bit (f16 / bf16) or 8-bit (e4m3 / i8) in pages of page_size tokens, in
the layout the decode kernel reads (K and V rows per token, [page][kv head][token][D]); 8-bit sides
carry one fp32 scale per (token, kv head)
(scale="token", dynamic) or one per kv head (scale="head", static: given, or calibrated from the first
write). ``write(k, v, slots)`` quantizes and scatters new tokens (slot = page * page_size + offset,
vLLM's slot mapping; negative slots are padding) in one kernel launch::

    cache = qattn.PagedKVCache(num_pages=1024, page_size=32, kv_heads=8, head_dim=128, k="e4m3", v="e4m3")
    cache.write(k_new, v_new, slots)          # [T, 8, 128] fp16, slots [T] int32 or int64
    out = qattn.decode(q, cache, block_table, seq_lens)

A pre-bias residual K (``k_bias=b``, [kv_heads, head_dim], kept exact in fp32): the writer stores
K − b (so a large K-projection bias no longer sets the 8-bit scale and rounds the token-varying part
away) and the decode kernel adds q·b back to every score of the row, so the scores are those of the
stored residual plus b exactly. For K without RoPE (or biases added after it); see DESIGN §2.

Page means of an 8-bit K (``k_mean="page"``): the cache keeps a running channel mean of K (of K - b with
a bias) per kv head, and one mean vector μ_page per (page, kv head), fixed when a write starts the page
(stores its offset 0) to the running mean as of the previous write; the writer stores K - μ_page and the
decode kernel adds q·μ_page back to that page's scores, so the scores are exact for any μ while a
large, drifting channel mean no longer sets the 8-bit scale. μ_page is stored as int8 codes with one
fp32 scale (D + 4 bytes per page and kv head; μ = fl(code x scale), the same value subtracted and added
back). The running sums are int64 fixed point (x * 2^16, rounded) added by integer atomics, so the
mean has the same bits whatever the order of the writer's blocks; the block that finishes last turns
them into the snapshot the next write starts its pages with (all in the write's one launch). A fresh
cache's first write starts its pages with its own mean (computed from it by a few launches, once, as
head scales are calibrated). A write that starts a page must hold that page's tokens in slot order (a
slot mapping does); writing a page's offset 0 again restarts the page.

Q/K channel balancing of an 8-bit K (``k_balance``): scale-type outlier channels (large, with a sign that
varies by token, so no mean removes them) set each token's 8-bit scale and round the other channels away.
With one α per (kv head, channel), q·k = Σ_c (q_c α_c)(k_c / α_c) exactly, so the writer stores
(K - b - μ_page) x fl(1/α) (balanced after the bias and the page mean are taken off) and the decode kernel
multiplies q by α at its load; q·b and q·μ_page take q as given. ``k_balance="calibrate"`` computes α from the
first write (K - b, less the seeded page mean; a few launches, once): with m_c the channel's absmax and m̃
the median over the head's channels, α_c = 2^round(log2 sqrt(m_c / m̃)) where that is at least 2, else 1.
Powers of two make q·α (fp16/bf16) and K / α exact: balancing adds no rounding of its own. A given α
(fp32 [kv_heads, head_dim], positive and finite) need not be a power of two; q·α is then rounded to the
query's type. ``cache.k_balance`` is the α in use (a CuPy array; ones until a "calibrate" cache's first
write).

Post-RoPE keys with a pre-RoPE bias (``k_bias=b, rope=qattn.RoPE(...)``, an 8-bit K): models such as Qwen add a
large K bias before RoPE, so the cached key k = R_p(k_pre) carries R_p b, which turns with the position p. The
writer takes each token's position (``write(..., positions=)``: its index in its sequence) and stores
k - R_p b; the decode kernel adds q·R_p b back per key, key j of a sequence at position j (its index in the
sequence as the block table orders its pages): exact by construction, R_p being the map of decode.rope (fp32
angles as HF computes them, fp16 cos/sin in a table of max_positions rows). Pre-RoPE keys
(``k_bias_layout="pre-rope"``: ``write`` takes k_pre, no positions): the writer stores k_pre - b and the
kernel turns each key's codes by R_p on chip before QK (fp32, rounded to the query's type) and adds q·R_p b:
the transform path only, without page means or balancing, and slower than post-RoPE keys (the rotation
runs for every key of every query block).
"""
from __future__ import annotations

import itertools
import weakref

import numpy as np

from ...engine.arrays import as_device_array, launch_stream
from ...engine.memory import capturing
from ...engine.packed import NULL, PackedLaunch, Pointer
from .quant import QMAX, HostPagedCache, balance_factors, balance_inverse, checked_balance, checked_layout
from .quant import PageMeans, mean_record, mean_terms, mean_values
from .rope import RoPE, constant_bias, rotated_bias
from .recipes import EIGHT_BIT, FORMATS, HALF, HEAD_DIMS, K_MEANS, PAGE_SIZES, SCALE_MODES, resolve_qk, tile_path_problem

# The writer's block: 16 tokens of one kv head, over 4 warps of 4 tokens each on CUDA (more rows in flight
# per warp) and 8 groups of 2 on HIP.
WRITE_TOKENS = 16
WRITE_THREADS = {"cuda": 128, "hip": 256}
DTYPES = {"f16": "float16", "bf16": "bfloat16"}

# Live caches by handle: an integer names a cache where an object cannot go (torch.ops.qattn.decode).
_HANDLES = itertools.count(1)
LIVE: "weakref.WeakValueDictionary[int, PagedKVCache]" = weakref.WeakValueDictionary()


def _on_host(given):
    """k_balance as checked_balance takes it: a string or None as given, an array (CuPy, torch, NumPy) on the host."""
    if given is None or isinstance(given, str):
        return given
    import cupy

    return cupy.asnumpy(cupy.asarray(given)) if hasattr(given, "__cuda_array_interface__") else np.asarray(given)


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def _cuda_device(device) -> int:
    """The CUDA device a cache lives on: `device` (an index), or the current one."""
    import cupy

    if not cupy.cuda.is_available():
        raise RuntimeError("device: a PagedKVCache lives on a CUDA GPU and none is available here "
                           "(qattn.formats.decode.quant.HostPagedCache is its host model)")
    count = cupy.cuda.runtime.getDeviceCount()
    if device is None:
        return cupy.cuda.Device().id
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)) or not 0 <= device < count:
        raise ValueError(f"device: expected a CUDA device index from 0 to {count - 1}, got {device!r}")
    return int(device)


class PagedKVCache:
    """num_pages pages of page_size tokens for kv_heads heads of head_dim channels; k and v each one of
    "f16", "bf16", "e4m3", "i8" (a 16-bit side is the queries' type; both 16-bit sides alike)."""

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, *, k: str = "f16",
                 v: str = "f16", scale: str = "token", k_scale=None, v_scale=None, k_bias=None,
                 k_mean: str = "off", k_balance=None, rope: RoPE | None = None, k_bias_layout: str = "post-rope",
                 device: int | None = None):
        import cupy

        self.num_pages = _positive(num_pages, "num_pages")
        self.kv_heads = _positive(kv_heads, "kv_heads")
        if page_size not in PAGE_SIZES:
            raise ValueError(f"page_size: expected one of {', '.join(map(str, sorted(PAGE_SIZES)))}, got {page_size!r}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: expected one of {', '.join(map(str, HEAD_DIMS))}, got {head_dim!r}")
        for side, name in ((k, "k"), (v, "v")):
            if side not in HALF + EIGHT_BIT:
                raise ValueError(f"{name}: expected one of {', '.join(HALF + EIGHT_BIT)}, got {side!r}")
        # the writer indexes token rows (with the page-mean snapshot's) in 32 bits
        if (self.num_pages + 1) * self.kv_heads * page_size >= 2**31:
            raise ValueError(f"num_pages, kv_heads, page_size: at most 2^31 - 1 token rows ((num_pages + 1) * kv_heads "
                             f"* page_size), got ({self.num_pages} + 1) * {self.kv_heads} * {page_size}")
        self.format = f"{k}-{v}"
        self.handle = next(_HANDLES)
        LIVE[self.handle] = self
        if self.format not in FORMATS:
            raise ValueError(f"k, v: {self.format} is not a decode format; formats: {', '.join(FORMATS)}")
        if scale not in SCALE_MODES:
            raise ValueError(f"scale: expected one of {', '.join(SCALE_MODES)}, got {scale!r}")
        for side, given, name in ((k, k_scale, "k_scale"), (v, v_scale, "v_scale")):
            if given is not None and side in HALF:
                raise ValueError(f"{name}: the {side} side stores no scale")
            if given is not None and scale == "token":
                raise ValueError(f"{name}: token scales are computed per token; give a scale with scale='head'")
        if k_mean not in K_MEANS:
            raise ValueError(f"k_mean: expected one of {', '.join(map(repr, K_MEANS))}, got {k_mean!r}")
        if k_mean != "off" and k not in EIGHT_BIT:
            raise ValueError(f"k_mean: page means are for an 8-bit K ({' or '.join(EIGHT_BIT)}); the {k} K is stored "
                             "as given")
        if k_balance is not None and k not in EIGHT_BIT:
            raise ValueError(f"k_balance: channel balancing is for an 8-bit K ({' or '.join(EIGHT_BIT)}); the {k} K "
                             "is stored as given")
        balance = checked_balance(_on_host(k_balance), kv_heads, head_dim)
        if rope is not None:
            if not isinstance(rope, RoPE):
                raise ValueError(f"rope: expected None or a qattn.RoPE, got {rope!r}")
            if k_bias is None or k not in EIGHT_BIT:
                raise ValueError(f"rope: the residual K under RoPE is for an 8-bit K ({' or '.join(EIGHT_BIT)}) with a "
                                 f"k_bias (the K bias added before RoPE); got k={k!r}, k_bias "
                                 f"{'given' if k_bias is not None else 'None'}")
            rope = rope.resolved(int(head_dim), self.num_pages * int(page_size))
        checked_layout(k_bias_layout, rope, k_mean, k_balance)
        self.rope, self.k_bias_layout = rope, k_bias_layout
        self.page_size, self.head_dim, self.scale, self.k_mean = int(page_size), int(head_dim), scale, k_mean
        self.k_dtype, self.v_dtype = k, v
        with cupy.cuda.Device(_cuda_device(device)) as dev:
            self.device = dev.id
            rows = (self.num_pages, self.kv_heads, self.page_size)
            self.k_pool = cupy.zeros(rows + (self.head_dim * (2 if k in HALF else 1),), dtype=cupy.uint8)
            self.v_pool = cupy.zeros(rows + (self.head_dim * (2 if v in HALF else 1),), dtype=cupy.uint8)
            self.k_scale = self._scale_buffer(k, k_scale, "k_scale")
            self.v_scale = self._scale_buffer(v, v_scale, "v_scale")
            self.k_bias = self._bias_buffer(k_bias)
            # what the kernel adds per row: b, or with RoPE b's non-rotary channels (R_p b comes per key)
            self._row_bias = self.k_bias if rope is None else cupy.asarray(constant_bias(cupy.asnumpy(self.k_bias), rope))
            self.rope_table = None if rope is None else cupy.asarray(rope.table())
            if balance is None:
                self.k_balance = self._k_unbalance = None
            else:  # α and fl(1/α); ones until a "calibrate" cache's first write
                alpha = np.ones((self.kv_heads, self.head_dim), np.float32) if isinstance(balance, str) else balance
                self.k_balance, self._k_unbalance = cupy.asarray(alpha), cupy.asarray(balance_inverse(alpha))
            if k_mean == "page":  # the records (the last: the running mean's snapshot), the sums and the ticket
                self.mean_codes = cupy.zeros((self.num_pages + 1, self.kv_heads, self.head_dim), dtype=cupy.int8)
                self.mean_scale = cupy.zeros((self.num_pages + 1, self.kv_heads), dtype=cupy.float32)
                self.mean_sums = cupy.zeros(self.kv_heads * (self.head_dim + 1) + 1, dtype=cupy.int64)
            else:
                self.mean_codes = self.mean_scale = self.mean_sums = None
        self._mean_seeded = k_mean == "off"
        self._balanced = not isinstance(balance, str)
        # head scales left to the first write (token scales are the writer's, per token)
        self._calibrated = {name: scale != "head" or given is not None or side in HALF
                            for name, side, given in (("k", k, k_scale), ("v", v, v_scale))}
        self._launches: dict = {}

    def _scale_buffer(self, side: str, given, name: str):
        import cupy

        if side in HALF:
            return None
        if self.scale == "token":
            return cupy.zeros((self.num_pages, self.kv_heads, self.page_size), dtype=cupy.float32)
        if given is None:
            return cupy.zeros(self.kv_heads, dtype=cupy.float32)  # calibrated by the first write
        scale = cupy.asarray(given, dtype=cupy.float32).reshape(-1)
        if scale.size == 1:
            scale = cupy.full(self.kv_heads, float(scale[0]), dtype=cupy.float32)
        if scale.shape != (self.kv_heads,) or not bool(cupy.all(cupy.isfinite(scale) & (scale > 0))):
            raise ValueError(f"{name}: expected one positive finite scale per kv head ({self.kv_heads}), got {given!r}")
        return scale

    def _bias_buffer(self, given):
        import cupy

        if given is None:
            return None
        bias = cupy.asarray(given, dtype=cupy.float32)
        if bias.shape != (self.kv_heads, self.head_dim) or not bool(cupy.all(cupy.isfinite(bias))):
            raise ValueError(f"k_bias: expected finite values [kv_heads, head_dim] = [{self.kv_heads}, "
                             f"{self.head_dim}], got shape {tuple(bias.shape)}")
        return cupy.ascontiguousarray(bias)

    # ---- the kernel module -----------------------------------------------------------------------
    def spec(self, arch: str | None = None, tile=None, qk: str = "auto", rows: int = 1):
        """The decode kernel spec of this cache on a QK path ("auto": the arch's pick for `rows` packed
        query rows per kv head, GQA x new tokens); its module also holds the writer."""
        from ...engine.spec import KernelSpec, device_arch

        if arch is None:
            import cupy

            with cupy.cuda.Device(self.device):
                arch = device_arch()
        options = {"page_size": self.page_size, "scale_mode": self.scale}
        path = "transform" if self.pre_rope and qk == "auto" else resolve_qk(self.format, arch, qk, rows)
        problem = tile is not None and tile_path_problem(tile, path, arch)
        if problem:
            raise ValueError(problem)
        if self.k_dtype in EIGHT_BIT:
            options["qk"], options["k_mean"] = path, self.k_mean
            options["k_balance"] = "off" if self.k_balance is None else "on"
            options["k_rope"] = "off" if self.rope is None else "pre" if self.pre_rope else "post"
        return KernelSpec(kind="decode", recipe=self.format, head_dim=self.head_dim, arch=arch, options=options,
                          **({"tile": tile} if tile is not None else {}))

    def kernel(self, tile=None, qk: str = "auto", rows: int = 1):
        """The decode kernel of this cache (built or loaded once per tile, QK path and row count: every
        decode call asks for it, and making its spec costs more host time than the launches)."""
        from ...engine.kernel import build_kernel

        kernels = self.__dict__.setdefault("_kernels", {})
        found = kernels.get((tile, qk, rows))
        if found is None:
            found = kernels[(tile, qk, rows)] = build_kernel(self.spec(tile=tile, qk=qk, rows=rows))
        return found

    # ---- writing ---------------------------------------------------------------------------------
    def write(self, k, v, slots, *, positions=None, stream=None) -> None:
        """Quantize and scatter new tokens k, v [T, kv_heads, head_dim] (fp16 or bf16, any token and
        head strides, channels contiguous) into slots [T] (int32 or int64, on the same GPU), in one
        launch on the caller's stream (torch's current stream for torch tensors); with post-RoPE keys, each
        token's position [T] (its index in its sequence; the dtype of slots) as positions. With head scales
        not given (or k_balance="calibrate"), the first write also computes them from its k and v (a few
        more launches, once)."""
        example = k
        k, v, slots = as_device_array(k, "k"), as_device_array(v, "v"), as_device_array(slots, "slots")
        for x, name in ((k, "k"), (v, "v")):
            if x.ndim != 3 or x.shape[1:] != (self.kv_heads, self.head_dim):
                raise ValueError(f"{name}: expected [tokens, {self.kv_heads}, {self.head_dim}], got shape {x.shape}")
            if x.dtype.name not in ("float16", "bfloat16"):
                raise TypeError(f"{name}: expected float16 or bfloat16, got {x.dtype.name}")
            if x.strides[-1] != 2 or any(s % 2 for s in x.strides):
                raise ValueError(f"{name}: the head_dim axis must be contiguous, got strides {x.strides}")
            if x.data.device_id != self.device:
                raise ValueError(f"{name}: on device {x.data.device_id}, the cache on {self.device}")
        if k.dtype != v.dtype or k.shape[0] != v.shape[0]:
            raise ValueError(f"k, v: expected the same dtype and token count, got {k.dtype.name} {k.shape[0]} and "
                             f"{v.dtype.name} {v.shape[0]}")
        for side, name in ((self.k_dtype, "k"), (self.v_dtype, "v")):
            if side in HALF and k.dtype.name != DTYPES[side]:
                raise TypeError(f"{name}: the cache stores {side}; got {k.dtype.name}")
        if slots.ndim != 1 or slots.shape[0] != k.shape[0] or slots.dtype.name not in ("int32", "int64"):
            raise ValueError(f"slots: expected int32 or int64 [{k.shape[0]}], got {slots.dtype.name} {slots.shape}")
        if slots.data.device_id != self.device:
            raise ValueError(f"slots: on device {slots.data.device_id}, the cache on {self.device}")
        positions = self._checked_positions(positions, slots)
        tokens = int(k.shape[0])
        if tokens == 0:
            return
        stream_ptr = launch_stream(stream, example)
        calibrating = not (all(self._calibrated.values()) and self._mean_seeded and self._balanced)
        if calibrating and capturing(stream_ptr):
            raise ValueError("k: the first write of a cache without given head scales calibrates them (with page "
                             "means seeds the mean, with k_balance='calibrate' computes α), which a CUDA graph capture "
                             "cannot hold; write once before the capture (or give k_scale=, v_scale=, k_balance=α)")
        if calibrating:  # from the K residual the writer codes
            residual = self._residual(k, positions)
            self._seed_mean(residual, slots)
            self._calibrate_balance(residual, slots)
            self._calibrate(residual, v)
        key = (k.dtype.name, slots.dtype.name, k.strides, v.strides, tokens)
        launch = self._launches.get(key)
        if launch is None:
            launch = self._write_launch(k, v, slots, tokens)
            self._launches[key] = launch
        pointers = {"k": k.data.ptr, "v": v.data.ptr, "slots": slots.data.ptr, "kp": self.k_pool.data.ptr,
                    "vp": self.v_pool.data.ptr, "ks": 0 if self.k_scale is None else self.k_scale.data.ptr,
                    "vs": 0 if self.v_scale is None else self.v_scale.data.ptr,
                    "pos": 0 if positions is None else positions.data.ptr, **self.k_term_pointers()}
        launch(pointers, stream_ptr)

    @property
    def pre_rope(self) -> bool:
        return self.rope is not None and self.k_bias_layout == "pre-rope"

    def _checked_positions(self, positions, slots):
        """positions as the writer reads them: given (with the slots' dtype and shape, on the cache's GPU) iff
        the cache holds post-RoPE keys."""
        if self.rope is None or self.pre_rope:
            if positions is not None:
                raise ValueError("positions: only a cache of post-RoPE keys (rope=, k_bias_layout='post-rope') takes "
                                 "the tokens' positions")
            return None
        if positions is None:
            raise ValueError("positions: a cache of post-RoPE keys needs each token's position (its index in its "
                             "sequence)")
        positions = as_device_array(positions, "positions")
        if positions.shape != slots.shape or positions.dtype != slots.dtype or positions.data.device_id != self.device:
            raise ValueError(f"positions: expected {slots.dtype.name} {slots.shape} on device {self.device} (as slots), "
                             f"got {positions.dtype.name} {positions.shape} on device {positions.data.device_id}")
        return positions

    def _write_launch(self, k, v, slots, tokens: int) -> PackedLaunch:
        kernel = self.kernel()
        suffix = f"_write_{'bf16' if k.dtype.name == 'bfloat16' else 'f16'}_{'i64' if slots.dtype.name == 'int64' else 'i32'}"
        head = self.scale == "head"
        args = (Pointer("k"), Pointer("v"), Pointer("slots"), Pointer("kp"), Pointer("vp"),
                Pointer("ks") if not head else Pointer(None), Pointer("vs") if not head else Pointer(None),
                Pointer("ks") if head else Pointer(None), Pointer("vs") if head else Pointer(None), Pointer("kb"),
                *self._mean_args(), *((Pointer("kr"),) if self.k_balance is not None else ()),
                *((Pointer("rt"), Pointer("pos"), *self._rope_ints()) if self.rope is not None and not self.pre_rope
                  else ()),
                np.int64(k.strides[0] // 2), np.int64(k.strides[1] // 2), np.int64(v.strides[0] // 2),
                np.int64(v.strides[1] // 2), np.int32(tokens), np.int32(self.kv_heads))
        return PackedLaunch(kernel.function(suffix), (-(-tokens // WRITE_TOKENS), self.kv_heads, 1),
                            WRITE_THREADS[kernel.spec.backend], 0, args)

    def _mean_args(self) -> tuple:
        """The writer's page-mean pointers: sums, page records (codes, scales), the snapshot record."""
        if self.k_mean == "off":
            return (NULL,) * 5
        records = self.num_pages * self.kv_heads
        return (Pointer("msum"), Pointer("mc"), Pointer("ms"), Pointer("mc", records * self.head_dim),
                Pointer("ms", records * 4))

    def _rope_ints(self) -> tuple:
        return np.int32(self.rope.rotary_dim), np.int32(self.rope.gptj), np.int32(self.rope.max_positions)

    def decode_term_args(self) -> tuple:
        """The decode kernel's arguments after seq_lens for its options: α (k_balance), the RoPE table, b and
        the RoPE ints (k_rope)."""
        balance = (Pointer("ka"),) if self.k_balance is not None else ()
        return balance + ((Pointer("rt"), Pointer("kb"), *self._rope_ints()) if self.rope is not None else ())

    def k_term_pointers(self) -> dict:
        """The device pointers of K's exact terms by launch name (zeros where off): the bias (kb, the writer's
        and the RoPE term's; kbq, what the kernel adds per row), the page means (sums, codes, scales), α and
        fl(1/α), the RoPE table."""
        buffers = {"kb": self.k_bias, "kbq": self._row_bias, "msum": self.mean_sums, "mc": self.mean_codes,
                   "ms": self.mean_scale, "ka": self.k_balance, "kr": self._k_unbalance, "rt": self.rope_table}
        return {name: 0 if x is None else x.data.ptr for name, x in buffers.items()}

    def _residual(self, k, positions):
        """K - b in fp32 (K with no bias; K - R_p b with post-RoPE keys), as the writer computes it."""
        import cupy

        x = k.astype("float32")
        if self.k_bias is None:
            return x
        if self.rope is None or self.pre_rope:
            return x - self.k_bias[None]
        return x - rotated_bias(self.k_bias, self.rope, self.rope_table, positions, cupy)

    def _seed_mean(self, x, slots) -> None:
        """A fresh cache's first write (x: its K residual): the snapshot its pages start with is its own mean
        (the rows the writer counts: stored and finite), from the same fixed-point sums (PageMeans.seed)."""
        import cupy

        if self._mean_seeded:
            return
        keep = (slots >= 0)[:, None] & cupy.isfinite(x).all(axis=2)
        sums = (mean_terms(x, cupy) * keep[..., None]).sum(axis=0)
        self.mean_codes[-1], self.mean_scale[-1] = mean_record(sums, keep.sum(axis=0), cupy)
        self._mean_seeded = True

    def _calibrate_balance(self, x, slots) -> None:
        """k_balance="calibrate": α from the first write's stored rows of its K residual x (less the seeded
        mean with page means), as quant.balance_factors computes it."""
        import cupy

        if self._balanced:
            return
        if self.k_mean != "off":
            x = x - mean_values(self.mean_codes[-1], self.mean_scale[-1], cupy)[None]
        alpha = balance_factors(cupy.where((slots >= 0)[:, None, None], x, cupy.float32(0)), cupy)
        self.k_balance[...] = alpha
        self._k_unbalance[...] = balance_inverse(alpha, cupy)
        self._balanced = True

    def _calibrate(self, residual, v) -> None:
        """Head scales not given: max|x| / QMAX over the first write's tokens and channels (of K - b
        with a bias, less the seeded mean with page means: about what is stored)."""
        import cupy

        for name, x, side in (("k", residual, self.k_dtype), ("v", v, self.v_dtype)):
            if self._calibrated[name]:
                continue
            x = x.astype(cupy.float32)
            if name == "k" and self.k_mean != "off":
                x = x - mean_values(self.mean_codes[-1], self.mean_scale[-1], cupy)[None]
            if name == "k" and self.k_balance is not None:
                x = x * self._k_unbalance[None]
            absmax = cupy.abs(x).max(axis=(0, 2))
            scale = (absmax / np.float32(QMAX[side])).astype(cupy.float32)
            getattr(self, f"{name}_scale")[...] = cupy.where(scale > 0, scale, cupy.float32(1))
            self._calibrated[name] = True

    # ---- reading back ----------------------------------------------------------------------------
    def host(self) -> HostPagedCache:
        """The cache on the host in natural layout (the emulator's input): stored values per token."""
        import cupy

        from ...check.quant import E4M3

        def values(raw, side):
            raw = cupy.asnumpy(raw)
            if side in HALF:
                data = raw.view(np.uint16)
                values = (data.astype(np.uint32) << 16).view(np.float32) if side == "bf16" else \
                    data.view(np.float16).astype(np.float32)
            else:
                values = raw.view(E4M3 if side == "e4m3" else np.int8).astype(np.float32)
            return np.ascontiguousarray(values)

        def scales(buffer):
            return None if buffer is None else cupy.asnumpy(buffer)

        means = None
        if self.k_mean != "off":
            sums = cupy.asnumpy(self.mean_sums[:-1]).reshape(self.kv_heads, self.head_dim + 1)
            means = PageMeans(cupy.asnumpy(self.mean_codes), cupy.asnumpy(self.mean_scale), sums[:, :-1].copy(),
                              sums[:, -1].copy(), self._mean_seeded)
        return HostPagedCache(self.format, self.page_size, values(self.k_pool, self.k_dtype),
                              values(self.v_pool, self.v_dtype), scales(self.k_scale), scales(self.v_scale),
                              scales(self.k_bias), means, scales(self.k_balance), self.rope,
                              None if self.rope is None else cupy.asnumpy(self.rope_table), self.k_bias_layout)
