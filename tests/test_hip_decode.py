"""HIP decode: the 8-bit QK paths (qk "fp8" over an e4m3 K cache, "int8" over an i8 one) and the cache
writer, compiled offline with clang-19 (no ROCm, no AMD GPU). Each 8-bit spec's attention entries (one per
query type the format takes) run S^T on the target's 8-bit matrix op (fp8 MFMA on gfx942, fp8 WMMA on
gfx1201, int8 MFMA / iu8 WMMA on all four) and only PV on the 16-bit op of their query type; every entry of
the module (attention, merge, the four writers) stays out of scratch. The archs without an fp8 op refuse qk "fp8" at KernelSpec construction. The
writer's e4m3 encoder and gfx942's e4m3fn -> e4m3fnuz K remap are cut from the rendered source,
compiled for the host and checked against ml_dtypes on every code. The sweep over every spec is
tools/hip_decode_sweep.py."""
import ctypes
import itertools
import re

import ml_dtypes
import numpy as np
import pytest

import qattn
from qattn.check.quant import to_e4m3
from qattn.engine.compile import resource_remarks
from qattn.engine.family import HIP_ARCHS
from qattn.engine.render import entry_name, main_entry_name, render
from qattn.engine.spec import KernelSpec
from qattn.formats.decode.recipes import HEAD_DIMS, HIP_QK_ARCHS, PAGE_SIZES, SCALE_MODES

from hip_offline import (HOST_BLOCKS, HOST_FLAGS, MATRIX_OP, WAVE, built, cut_function, host_library, needs_clang,
                         op_count, query_types)

pytestmark = needs_clang

WRITERS = [f"_write_{t}_{s}" for t in ("f16", "bf16") for s in ("i32", "i64")]
FORMATS = {"fp8": ("e4m3-e4m3", "e4m3-f16", "e4m3-bf16"), "int8": ("i8-i8", "i8-f16", "i8-bf16")}


def _spec(fmt, arch, d=128, page=16, scale="token", qk=None) -> KernelSpec:
    options = {"page_size": page, "scale_mode": scale, **({"qk": qk} if qk else {})}
    return KernelSpec(kind="decode", recipe=fmt, head_dim=d, backend="hip", arch=arch, options=options)


def _subset() -> list[KernelSpec]:
    """Every (8-bit path, arch that has it, format) once, the head dims, page sizes and scale modes
    taken in turn so that each appears."""
    combos = [(qk, arch, fmt) for qk, archs in HIP_QK_ARCHS.items() for arch in archs for fmt in FORMATS[qk]]
    shapes = itertools.cycle(itertools.product(HEAD_DIMS, SCALE_MODES))
    return [_spec(fmt, arch, d, PAGE_SIZES[i % len(PAGE_SIZES)], scale, qk)
            for i, ((qk, arch, fmt), (d, scale)) in enumerate(zip(combos, shapes))]


SPECS = _subset()


# ---- options and refusals -----------------------------------------------------------------------

def test_qk_option_per_format():
    for fmt, paths in (("e4m3-e4m3", ("transform", "fp8")), ("e4m3-f16", ("transform", "fp8")),
                       ("i8-i8", ("transform", "int8")), ("i8-f16", ("transform", "int8"))):
        assert qattn.recipe(fmt, "decode").family("hip").options["qk"] == paths
    for fmt in ("f16-f16", "f16-e4m3", "f16-i8"):  # a 16-bit K has its own op only
        assert "qk" not in qattn.recipe(fmt, "decode").family("hip").options
        with pytest.raises(ValueError, match="^options: .* takes page_size, scale_mode, got qk"):
            _spec(fmt, "gfx942", qk="int8")
    spec = _spec("e4m3-e4m3", "gfx942", qk="fp8")
    assert spec.options[-1] == ("qk", "fp8") and spec.name.endswith("_token_fp8_gfx942")
    assert _spec("e4m3-e4m3", "gfx1100").options[-1] == ("qk", "transform")  # the default


@pytest.mark.parametrize("fmt", FORMATS["fp8"])
@pytest.mark.parametrize("arch", [a for a in HIP_ARCHS if a not in HIP_QK_ARCHS["fp8"]])
def test_fp8_refused_without_an_fp8_matrix_op(fmt, arch):
    with pytest.raises(ValueError, match=rf"^qk: {arch} has no fp8 matrix op \(fp8 builds on gfx942, gfx1201; "
                                         rf"{arch} builds transform, int8\): {fmt} on {arch} takes qk transform"):
        _spec(fmt, arch, qk="fp8")
    assert _spec(fmt, arch, qk="transform").arch == arch


def test_path_must_match_the_k_code():
    with pytest.raises(ValueError, match="^qk: i8-i8 takes one of transform, int8, got 'fp8'"):
        _spec("i8-i8", "gfx942", qk="fp8")
    with pytest.raises(ValueError, match="^qk: e4m3-f16 takes one of transform, fp8, got 'int8'"):
        _spec("e4m3-f16", "gfx1201", qk="int8")


def test_cuda_family_takes_no_arch_refusal():
    """The CUDA family refuses no arch; its one option rule is pre-RoPE keys' (the transform path only)."""
    from qattn.engine.family import CUDA_ARCHS

    problem = qattn.recipe("e4m3-e4m3", "decode").family("cuda").option_problem
    assert all(problem({"qk": qk, "k_rope": rope}, arch, 256) is None for arch in CUDA_ARCHS
               for qk in ("transform", "fp8") for rope in ("off", "post"))
    assert problem({"qk": "fp8", "k_rope": "pre"}, "sm_90a", 128).startswith("qk: the pre-RoPE residual K")


# ---- compiled code ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", HIP_ARCHS)
@pytest.mark.parametrize("fmt", ["e4m3-e4m3", "i8-f16", "f16-e4m3", "f16-f16", "bf16-bf16", "e4m3-bf16", "bf16-i8"])
def test_hip_decode_compiles_to_16bit_matrix_ops(fmt, arch):
    """The transform path on AMD: 8-bit codes widened in LDS to the queries' type, both products on the
    target's MFMA / WMMA of that type (fp16 or bf16), an entry per query type the format takes, nothing
    in scratch. Offline (clang-19); running it needs ROCm."""
    spec = _spec(fmt, arch)
    source = render(spec)
    assert "mma.sync" not in source and "cp.async" not in source
    binary, funcs = built(spec)
    remarks = resource_remarks(binary.log)
    types = query_types(fmt)
    assert main_entry_name(spec) == entry_name(spec) + "_" + types[0]
    for t in ("f16", "bf16"):
        name = entry_name(spec) + "_" + t
        assert (name in funcs) == (t in types), (t, sorted(funcs))
        if t not in types:
            continue
        own, other = (op_count(MATRIX_OP[kind, arch], funcs[name]) for kind in (t, "bf16" if t == "f16" else "f16"))
        assert own >= 2 * 128 // 16 and other == 0, (t, own, other)  # S^T and O^T: an op per 16 channels of each
        assert ("v_wmma" if arch.startswith("gfx9") else "v_mfma") not in funcs[name]
        for entry in (name, entry_name(spec) + "_merge_" + t):
            assert remarks[entry]["ScratchSize"] == 0 and remarks[entry]["VGPRs Spill"] == 0, (entry, remarks[entry])


def test_hip_decode_takes_both_query_types():
    for fmt in ("bf16-e4m3", "e4m3-e4m3", "f16-f16"):
        assert qattn.recipe(fmt, "decode").family("hip").values["query_types"] == \
            tuple("bf16" if t == "bfloat16" else "f16" for t in qattn.recipe(fmt, "decode").input_dtypes)
    assert qattn.recipe("e4m3-e4m3", "decode").family("hip").values["query_types"] == ("f16", "bf16")
    with pytest.raises(ValueError, match="HIP decode kernel runs m32n32w2s1 only"):
        KernelSpec(kind="decode", recipe="e4m3-e4m3", backend="hip", arch="gfx942", tile=qattn.Tile(32, 64, 2, 1))


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_8bit_qk_compiles_to_8bit_matrix_ops(spec):
    source = render(spec)
    assert "mma.sync" not in source and "asm(" not in source  # no CUDA leaks in
    binary, funcs = built(spec)
    qk = dict(spec.options)["qk"]
    name = entry_name(spec)
    types = query_types(spec.recipe)
    mt, nt, dt = WAVE[spec.arch] // 32, spec.tile.block_n // 16, spec.head_dim // 16
    for t in types:
        main = funcs[name + "_" + t]
        qk_ops, pv_ops = op_count(MATRIX_OP[qk, spec.arch], main), op_count(MATRIX_OP[t, spec.arch], main)
        # S^T: the 8-bit op for every (query tile, key tile) of a k step (the channel loop stays rolled);
        # the query type's 16-bit op for PV alone: one per (query tile, key tile, 16 channels).
        assert qk_ops >= mt * nt and qk_ops % (mt * nt) == 0, (t, qk_ops, mt * nt)
        assert pv_ops == mt * nt * dt, (t, pv_ops, mt * nt * dt)
        others = [op for (path, arch), op in MATRIX_OP.items() if arch == spec.arch and path not in (qk, t)]
        assert not any(op_count(op, main) for op in others), t
        assert "v_div_fixup_f32" in main  # s_q and q / s_q: IEEE division
        if qk == "fp8":
            assert "v_cvt_pk_fp8_f32" in main  # Q's codes on the target's converter
    assert ("v_wmma" if spec.arch.startswith("gfx9") else "v_mfma") not in "".join(funcs.values())
    entries = [s for t in types for s in (f"_{t}", f"_merge_{t}")] + WRITERS
    for t in ("f16", "bf16"):  # an entry for each query type the format takes, and none for another
        assert (name + "_" + t in funcs) == (name + "_merge_" + t in funcs) == (t in types), (t, sorted(funcs))
    assert all(name + s in funcs for s in WRITERS)
    remarks = resource_remarks(binary.log)
    for entry in [name + s for s in entries]:
        r = remarks[entry]
        # (SGPR spills, which the transform path has too, go to VGPR lanes, not to scratch)
        assert r["ScratchSize"] == 0 and r["VGPRs Spill"] == 0, (entry, r)
        assert 0 < r["VGPRs"] <= 256, (entry, r)


@pytest.mark.parametrize("fmt, arch, d, scale", [("f16-f16", "gfx90a", 64, "token"), ("f16-e4m3", "gfx942", 256, "head"),
                                                 ("f16-i8", "gfx1100", 128, "token"),
                                                 ("e4m3-e4m3", "gfx1201", 128, "head"),
                                                 ("bf16-e4m3", "gfx90a", 128, "head")])
def test_writer_entries_on_every_format_kind(fmt, arch, d, scale):
    """The transform-path modules carry the writer too; it encodes e4m3 in integer arithmetic (no fp8
    converter: gfx942's writes fnuz, gfx90a's and gfx11's do not exist) and runs no matrix op."""
    spec = _spec(fmt, arch, d, 32, scale)
    binary, funcs = built(spec)
    remarks = resource_remarks(binary.log)
    for suffix in WRITERS:
        body = funcs[entry_name(spec) + suffix]
        assert not re.search(r"v_(mfma|wmma|cvt_pk_fp8|cvt_f32_fp8)", body), suffix
        if fmt != "f16-f16":
            assert "v_div_fixup_f32" in body  # x / s: IEEE division
        r = remarks[entry_name(spec) + suffix]
        assert r["ScratchSize"] == 0 and r["VGPRs Spill"] == 0, (suffix, r)


# ---- the encoders, cut from the source and run on the host ---------------------------------------

@pytest.fixture(scope="module")
def host_encoders(tmp_path_factory):
    source = render(_spec("e4m3-e4m3", "gfx942", qk="fp8"))
    parts = [cut_function(source, signature) for signature in ("QATTN_DEVICE u32 e4m3fn_code(float y)",
                                                                "QATTN_DEVICE u32 k_codes(u32 w)")]
    text = ("#define QATTN_DEVICE static inline\ntypedef unsigned u32;\n" + "".join(parts) + """
extern "C" void encode(const float* y, u32* out, int n) { for (int i = 0; i < n; ++i) out[i] = e4m3fn_code(y[i]); }
extern "C" void remap(const u32* w, u32* out, int n) { for (int i = 0; i < n; ++i) out[i] = k_codes(w[i]); }
""")
    # __gfx942__ selects the fnuz remap, as on the target; -O2 without fast-math keeps IEEE rounding
    return host_library(tmp_path_factory.mktemp("encoders"), text, ["-D__gfx942__=1"])


def _encode(lib, y: np.ndarray) -> np.ndarray:
    y = np.ascontiguousarray(y, np.float32)
    out = np.zeros(y.size, np.uint32)
    lib.encode(y.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(y.size))
    return out


def test_writer_e4m3_encoder_matches_ml_dtypes(host_encoders):
    rng = np.random.default_rng(4)
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(np.abs(grid[np.isfinite(grid)]))
    mids = (grid[1:] + grid[:-1]) / 2  # ties: round to the even code
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    halves = halves[np.isfinite(halves)]
    y = np.concatenate([grid, -grid, mids, -mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                        halves, halves / np.float32(0.37), rng.uniform(-600, 600, 100000).astype(np.float32),
                        np.float32([448, 449, 464, 465, 1e30, np.inf, -np.inf, np.nan, -0.0, 1e-30, -1e-30, 2 ** -10])])
    with np.errstate(invalid="ignore", over="ignore"):
        want = to_e4m3(y).view(np.uint8).astype(np.uint32)
    got = _encode(host_encoders, y)
    nan = np.isnan(y)
    assert np.all(got[nan] == 0x7F)  # the CUDA writer's satfinite NaN
    bad = np.flatnonzero(got[~nan] != want[~nan])
    assert bad.size == 0, [(float(y[~nan][i]), hex(got[~nan][i]), hex(want[~nan][i])) for i in bad[:5]]


def test_gfx942_k_remap_reads_half_the_ocp_value(host_encoders):
    codes = np.arange(256, dtype=np.uint32)
    words = codes | np.roll(codes, 1) << 8 | np.roll(codes, 7) << 16 | np.roll(codes, 100) << 24
    out = np.zeros_like(words)
    host_encoders.remap(words.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                        ctypes.c_int(words.size))
    fn = words.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    fnuz = out.view(np.uint8).view(ml_dtypes.float8_e4m3fnuz).astype(np.float64)
    assert np.array_equal(np.isnan(fn), np.isnan(fnuz))
    ok = ~np.isnan(fn)
    np.testing.assert_array_equal(fnuz[ok], fn[ok] / 2)  # the product of two: 1/4, PRODUCT_UNIT puts it back



# ---- the int8 QK path's query codes, run on the host ------------------------------------------------

@pytest.mark.parametrize("arch", ["gfx90a", "gfx1100"])  # a wave of 64 lanes, and of 32
@pytest.mark.parametrize("balance", [False, True])
def test_int8_query_codes_are_the_emulators(tmp_path, arch, balance):
    """qk "int8": load_queries, cut from the rendered module and run on the host (hip_offline.HOST_BLOCKS), codes
    each packed row (head in group x token) of q (times α with balancing) with its own scale, as the decode
    emulator quantizes Q (quantize_tokens), and zeros the padding rows past the packed ones."""
    from qattn.engine.render import context
    from qattn.formats.decode.quant import quantize_tokens

    options = {"page_size": 16, "scale_mode": "token", "qk": "int8", **({"k_balance": "on"} if balance else {})}
    spec = KernelSpec(kind="decode", recipe="i8-i8", head_dim=64, backend="hip", arch=arch, options=options)
    source = render(spec)
    ctx = context(spec)
    parts = [cut_function(source, signature) for signature in (
        "QATTN_DEVICE float nan_max(float a, float b)", "QATTN_DEVICE u32 q_i8(float y)",
        "QATTN_DEVICE u32 q_codes(float y0, float y1, float y2, float y3)", "QATTN_DEVICE void load_queries(")]
    d, rows, threads = spec.head_dim, ctx["block_m"], ctx["threads"]
    qrow = d + 16  # the 8-bit QK path's LDS row (decode_paged.hip.j2)
    text = HOST_BLOCKS + f"""
namespace {{
constexpr int D = {d}, ROWS = {rows}, THREADS = {threads}, QROW = {qrow}, WAVE = {WAVE[arch]};
constexpr float QMAX = 127.f;
}}
""" + "".join(parts[:3]) + "template <class T>\n" + parts[3] + f"""
extern "C" void quantize(const f16* q, i64 q_h, i64 q_s, int packed, int Lq, unsigned char* Qs, float* scales,
                         const float* alpha) {{
    launch((packed + ROWS - 1) / ROWS, 1, 1, THREADS, [=] {{
        load_queries<f16>(Qs + block_x() * ROWS * QROW, scales + block_x() * ROWS, q, q_h, q_s, block_x() * ROWS,
                          packed, Lq, thread_id(){", alpha" if balance else ""});
    }});
}}
"""
    lib = host_library(tmp_path, text, HOST_FLAGS)
    rng = np.random.default_rng(int(balance) + len(arch))
    group, lq = 4, 13  # 52 packed rows: a partial second block
    q = (rng.standard_normal((group, lq + 3, d)) * 2).astype(np.float16)[:, :lq]  # strided rows
    q[1, 2, 9] *= 300  # one large channel
    alpha = np.where(rng.random(d) < 0.2, 2.0 ** rng.integers(-3, 4, d), 1.0).astype(np.float32)
    packed = group * lq
    blocks = -(-packed // rows)
    codes = np.full((blocks * rows, qrow), 0x5A, np.uint8)
    scales = np.full(blocks * rows, np.nan, np.float32)
    lib.quantize(q.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(q.strides[0] // 2),
                 ctypes.c_longlong(q.strides[1] // 2), ctypes.c_int(packed), ctypes.c_int(lq),
                 codes.ctypes.data_as(ctypes.c_void_p), scales.ctypes.data_as(ctypes.c_void_p),
                 alpha.ctypes.data_as(ctypes.c_void_p) if balance else None)
    rows16 = q.reshape(packed, d)
    want = quantize_tokens(rows16.astype(np.float32) * (alpha if balance else np.float32(1)), "i8")
    np.testing.assert_array_equal(codes[:packed, :d].view(np.int8), want.codes)
    np.testing.assert_array_equal(scales[:packed], want.scale)
    assert not codes[packed:, :d].any() and np.all(scales[packed:] == 0)  # padding rows: zero codes and scales
