"""HIP decode with the 8-bit K options, compiled offline with clang-19 (no ROCm): page means (k_mean
"page": the writer's running sums by integer atomics and its K - μ_page, the kernel's q·μ_page per page in
SIMT code) and channel balancing (k_balance "on": K's residual times fl(1/α) in the writer, q·α at the
kernel's Q load), on every target, every 8-bit K format and each QK path the target has. The products stay
on the path's matrix ops (q·μ_page takes none), and no entry of the module touches scratch. The writer's
fixed-point term and mean subtraction, cut from the rendered source and run on the host, match the host
model (decode.quant) bit for bit."""
import ctypes
import itertools
import re

import numpy as np
import pytest

from qattn.engine.compile import resource_remarks
from qattn.engine.family import HIP_ARCHS
from qattn.engine.render import entry_name, render
from qattn.engine.spec import KernelSpec
from qattn.formats.decode.quant import mean_terms, mean_values
from qattn.formats.decode.recipes import HEAD_DIMS, HIP_QK_ARCHS, PAGE_SIZES, SCALE_MODES, qk_paths

from hip_offline import MATRIX_OP, WAVE, built, cut_function, host_library, needs_clang, op_count, query_types

pytestmark = needs_clang

WRITERS = [f"_write_{t}_{s}" for t in ("f16", "bf16") for s in ("i32", "i64")]
FORMATS = ("e4m3-e4m3", "e4m3-f16", "i8-i8", "i8-f16")
MEAN, BALANCE, ROPE = {"k_mean": "page"}, {"k_balance": "on"}, {"k_rope": "post"}


def _spec(fmt, arch, qk, options, d=128, page=16, scale="token") -> KernelSpec:
    return KernelSpec(kind="decode", recipe=fmt, head_dim=d, backend="hip", arch=arch,
                      options={"page_size": page, "scale_mode": scale, "qk": qk, **options})


def _cases() -> list[KernelSpec]:
    """Every (target, 8-bit format, QK path the target has) with both options; then each (target, path)
    with one option alone, the option and the format alternating. Head dims, page sizes and scale modes
    taken in turn."""
    combos = [(arch, fmt, qk, {**MEAN, **BALANCE}) for arch in HIP_ARCHS for fmt in FORMATS for qk in qk_paths(fmt)
              if qk == "transform" or arch in HIP_QK_ARCHS[qk]]
    pairs = sorted({(arch, qk) for arch, _, qk, _ in combos})
    combos += [(arch, FORMATS[i // 2 % 2 + (2 if qk == "int8" else 0)], qk, (MEAN, BALANCE)[i % 2])
               for i, (arch, qk) in enumerate(pairs)]
    shapes = itertools.cycle(itertools.product(HEAD_DIMS, PAGE_SIZES, SCALE_MODES))
    return [_spec(fmt, arch, qk, options, d, page, scale)
            for (arch, fmt, qk, options), (d, page, scale) in zip(combos, shapes)]


CASES = _cases()


def test_cases_cover_every_target_format_and_path():
    both = {(s.arch, s.recipe, dict(s.options)["qk"]) for s in CASES
            if dict(s.options)["k_mean"] == "page" and dict(s.options)["k_balance"] == "on"}
    assert both == {(arch, fmt, qk) for arch in HIP_ARCHS for fmt in FORMATS for qk in qk_paths(fmt)
                    if qk == "transform" or arch in HIP_QK_ARCHS[qk]}
    alone = [(s.arch, dict(s.options)["qk"], dict(s.options)["k_mean"]) for s in CASES
             if (dict(s.options)["k_mean"] == "page") != (dict(s.options)["k_balance"] == "on")]
    assert {(a, q) for a, q, _ in alone} == {(a, q) for a, _, q in both} and len(alone) == len({(a, q) for a, _, q in both})
    assert {m for _, _, m in alone} == {"page", "off"}
    assert {s.head_dim for s in CASES} == set(HEAD_DIMS) and {dict(s.options)["page_size"] for s in CASES} == set(PAGE_SIZES)


def test_options_build_on_hip_and_rope_keys_stop_at_d128():
    spec = _spec("i8-i8", "gfx942", "int8", {**MEAN, **BALANCE})
    assert "_kmean-page_kbal_int8_gfx942" in spec.name
    for rope, qk in (("post", "int8"), ("pre", "transform")):
        with pytest.raises(ValueError, match=rf"^k_rope: the HIP decode kernel's RoPE term needs head_dim <= 128 "
                                             rf"\(LDS\), got 256; k_rope '{rope}' builds at d256 for CUDA"):
            _spec("i8-i8", "gfx942", qk, {"k_rope": rope}, d=256)
    assert _spec("e4m3-e4m3", "gfx1201", "fp8", {"k_rope": "post"}).name.endswith("_krope-post_fp8_gfx1201")
    off = render(_spec("e4m3-e4m3", "gfx1201", "fp8", {}))
    # (the page-mean pointers stay in the entries' parameters, the CUDA kernel's, unused)
    assert not any(word in off for word in ("mean_log2", "plus_mean", "less_mean", "encode_snapshot", "block_sums",
                                            "k_unbalance", "alpha", "k_balance"))


@pytest.mark.parametrize("spec", CASES, ids=[s.name for s in CASES])
def test_option_kernels_compile_to_their_matrix_ops(spec):
    options = dict(spec.options)
    qk, mean, balance = options["qk"], options["k_mean"] == "page", options["k_balance"] == "on"
    source = render(spec)
    assert "mma.sync" not in source and "asm(" not in source
    assert ("k_unbalance[h * D" in source) == balance and ("alpha[c" in source) == balance
    assert ("plus_mean(x, mean_log2" in source) == mean and ("less_mean(kf" in source) == mean
    binary, funcs = built(spec)
    name = entry_name(spec)
    mt, nt, dt = WAVE[spec.arch] // 32, spec.tile.block_n // 16, spec.head_dim // 16
    types = query_types(spec.recipe)
    for t in types:
        main = funcs[name + "_" + t]
        qk_ops = op_count(MATRIX_OP[t if qk == "transform" else qk, spec.arch], main)
        pv_ops = op_count(MATRIX_OP[t, spec.arch], main)
        # S^T on the path's op (its channel loop rolled), PV on the query type's 16-bit op; q·μ_page on no matrix op
        assert qk_ops >= mt * nt and qk_ops % (mt * nt) == 0, (t, qk_ops, mt * nt)
        if qk != "transform":
            assert pv_ops == mt * nt * dt, (t, pv_ops, mt * nt * dt)
        else:
            assert pv_ops >= mt * nt * (dt + 1) and (pv_ops - mt * nt * dt) % (mt * nt) == 0, (t, pv_ops)
        others = [op for (kind, arch), op in MATRIX_OP.items() if arch == spec.arch and kind not in (qk, t)]
        assert not any(op_count(op, main) for op in others), t
        assert not re.search(r"atomic|ds_add", main)
    assert ("v_wmma" if spec.arch.startswith("gfx9") else "v_mfma") not in "".join(funcs.values())
    remarks = resource_remarks(binary.log)
    for suffix in [s for t in types for s in (f"_{t}", f"_merge_{t}")] + WRITERS:
        r = remarks[name + suffix]
        # (SGPR spills go to VGPR lanes, not to scratch)
        assert r["ScratchSize"] == 0 and r["VGPRs Spill"] == 0, (suffix, r)
        assert 0 < r["VGPRs"] <= 256, (suffix, r)
    for suffix in WRITERS:
        writer = funcs[name + suffix]
        assert not re.search(r"v_(mfma|wmma)", writer)
        # page means: the block's sums by LDS atomics, then into the running sums by global ones
        assert bool(re.search(r"\bds_add_u64\b", writer)) == mean, suffix
        assert bool(re.search(r"\bglobal_atomic_add_(x2|u64)\b", writer)) == mean, suffix


# ---- the writer's page-mean arithmetic, cut from the source and run on the host ----------------------

@pytest.fixture(scope="module")
def host_mean(tmp_path_factory):
    source = render(_spec("i8-i8", "gfx1100", "int8", MEAN, d=128))  # EPL = 4
    parts = [cut_function(source, signature) for signature in (
        "QATTN_DEVICE u64 mean_term(float x)",
        "QATTN_DEVICE void less_mean(float (&x)[EPL], const unsigned char* codes, float scale)")]
    text = ("#define QATTN_DEVICE static inline\ntypedef long long i64;\ntypedef unsigned long long u64;\n"
            "constexpr int EPL = 4;\nconstexpr float MEAN_UNIT = 65536.f, MEAN_CLAMP = 16777216.f;\n" + "".join(parts) + """
extern "C" void terms(const float* x, u64* out, int n) { for (int i = 0; i < n; ++i) out[i] = mean_term(x[i]); }
extern "C" void less(float* x, const unsigned char* codes, const float* scale, int rows) {
    for (int r = 0; r < rows; ++r) less_mean(*reinterpret_cast<float(*)[EPL]>(x + EPL * r), codes + EPL * r, scale[r]);
}
""")
    assert "MEAN_UNIT = 65536.f, MEAN_CLAMP = 16777216.f" in source
    # contraction as HIP compiles (fast, honoring pragmas) on a host with FMA: less_mean's pragma must keep
    # the product rounded on its own
    return host_library(tmp_path_factory.mktemp("mean"), text, ["-ffp-contract=fast-honor-pragmas", "-march=native"])


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def test_mean_terms_match_the_host_model(host_mean):
    rng = np.random.default_rng(7)
    ties = (np.arange(-50, 50) + 0.5).astype(np.float32) * np.float32(2 ** -16)  # rint: to even
    x = np.concatenate([rng.standard_normal(20000).astype(np.float32) * np.float32(30), ties,
                        np.float32([0, -0.0, 2 ** 24, -2 ** 24, 2 ** 24 + 2, 1e30, -1e30, 3e-8, -3e-8])])
    out = np.zeros(x.size, np.uint64)
    host_mean.terms(_ptr(x), _ptr(out), ctypes.c_int(x.size))
    np.testing.assert_array_equal(out.view(np.int64), mean_terms(x))


def test_mean_subtraction_matches_the_host_model(host_mean):
    rng = np.random.default_rng(8)
    rows = 4096
    x = (rng.standard_normal((rows, 4)) * 40).astype(np.float32)
    codes = rng.integers(-127, 128, (rows, 4)).astype(np.int8)
    scale = (rng.random(rows) * 0.7).astype(np.float32)
    got = x.copy()
    host_mean.less(_ptr(got), _ptr(codes), _ptr(scale), ctypes.c_int(rows))
    want = (x - mean_values(codes, scale)).astype(np.float32)  # the product rounded, then subtracted
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _entry_params(source: str, entry: str) -> list[str]:
    """The parameter names of one extern "C" entry of a rendered source (through the HIP module's parameter macro)."""
    m = re.search(r"\b" + re.escape(entry) + r"\((.*?)\)\s*\{", source, re.S)
    assert m, entry
    text = m.group(1)
    if "QATTN_DECODE_PARAMS" in text:
        text = re.search(r"#define QATTN_DECODE_PARAMS\(T\)(.*?)\n(?!\s)", source, re.S).group(1).replace("\\\n", " ")
    return [re.findall(r"(\w+)\s*$", part.strip())[0] for part in text.split(",") if part.strip()]


@pytest.mark.parametrize("fmt, options", [("e4m3-e4m3", {**MEAN, **BALANCE}), ("i8-i8", MEAN), ("i8-f16", BALANCE),
                                          ("e4m3-f16", {}), ("f16-f16", None), ("bf16-e4m3", None),
                                          ("e4m3-e4m3", ROPE), ("i8-bf16", {**ROPE, **BALANCE}),
                                          ("i8-f16", {"k_rope": "pre"})])
def test_entries_take_the_cuda_kernels_arguments(fmt, options):
    """Each entry of a HIP module (attention, merge, writer) takes the arguments of the CUDA module's entry of the
    same spec, by name and in order (the bias and page-mean pointers too, null where unused), so that one host
    launch serves both."""
    spec_options = {"page_size": 32, "scale_mode": "head", **({} if options is None else {"qk": "transform", **options})}
    cuda = KernelSpec(kind="decode", recipe=fmt, head_dim=64, backend="cuda", arch="sm_90a", options=spec_options)
    hip = KernelSpec(kind="decode", recipe=fmt, head_dim=64, backend="hip", arch="gfx1100", options=spec_options)
    cuda_source, hip_source = render(cuda), render(hip)
    for t in query_types(fmt):
        for suffix in (f"_{t}", f"_merge_{t}", f"_write_{t}_i32", f"_write_{t}_i64"):
            names = _entry_params(hip_source, entry_name(hip) + suffix)
            assert names == _entry_params(cuda_source, entry_name(cuda) + suffix), suffix
    assert "k_bias" in _entry_params(hip_source, entry_name(hip) + f"_{query_types(fmt)[0]}")


def test_the_pre_bias_residual_k_on_hip():
    """The writer codes K - b (K's page means those of K - b), and the kernel adds q·b to every score of the row."""
    source = render(_spec("i8-i8", "gfx942", "int8", MEAN))
    assert "if (k_bias != nullptr) kf[i] -= k_bias[h * D + first + i];" in source
    assert source.index("kf[i] -= k_bias") < source.index("mean_term(kf[i])")  # the sums are of K - b
    assert "* row_factor[mt]) + row_bias[mt];" in source
    binary, funcs = built(_spec("i8-i8", "gfx942", "int8", MEAN))
    assert binary.resources["scratch"] == 0


# ---- post-RoPE keys ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, fmt, qk", [("gfx90a", "i8-i8", "int8"), ("gfx942", "e4m3-e4m3", "fp8"),
                                           ("gfx1100", "e4m3-f16", "transform"), ("gfx1201", "i8-bf16", "int8")])
def test_post_rope_kernels_add_the_term_on_the_fp16_op(arch, fmt, qk):
    """q·R_p b per key: two fp16 products (hi, lo terms) per 16 rotary dims and (query tile, key tile), beside
    the path's QK and the query type's PV; the writer turns the bias by the tokens' positions. No scratch."""
    spec = _spec(fmt, arch, qk, ROPE, d=128)
    binary, funcs = built(spec)
    mt, nt, dt = WAVE[arch] // 32, spec.tile.block_n // 16, spec.head_dim // 16
    remarks = resource_remarks(binary.log)
    for t in query_types(fmt):
        main = funcs[entry_name(spec) + "_" + t]
        f16_ops = op_count(MATRIX_OP["f16", arch], main)
        pv = mt * nt * dt if t == "f16" else 0
        qk_f16 = mt * nt if qk == "transform" and t == "f16" else 0  # (the channel loops stay rolled)
        assert f16_ops == pv + qk_f16 + 2 * mt * nt, (t, f16_ops)  # the rope loop rolled: one 16-dim step's
        assert remarks[entry_name(spec) + "_" + t]["ScratchSize"] == 0
    writer = render(spec)
    assert "rotated_bias(k_bias + h * D, rope_table + p * rotary_dim" in writer
    for suffix in WRITERS:
        assert remarks[entry_name(spec) + suffix]["ScratchSize"] == 0


@pytest.fixture(scope="module")
def host_rope(tmp_path_factory):
    source = render(_spec("i8-i8", "gfx1100", "int8", ROPE, d=128))
    parts = [cut_function(source, signature) for signature in (
        "template <bool BF16>\nQATTN_DEVICE float to_float(u16 x)",
        "QATTN_DEVICE float rotated_bias(const float* b, const u16* row, int c, int rotary_dim, bool gptj)",
        "QATTN_DEVICE void rope_term(float qa, float qz, float ba, float bz, float scale_log2, float& u, float& w)")]
    text = ("#define QATTN_DEVICE static inline\ntypedef unsigned u32;\ntypedef unsigned short u16;\n"
            "typedef _Float16 f16;\n" + "".join(parts) + """
extern "C" void bias(const float* b, const u16* table, const long long* positions, int tokens, int d, int rotary_dim,
                     int gptj, int max_positions, float* out) {
    for (int t = 0; t < tokens; ++t) {
        const long long p = positions[t] < 0 ? 0 : (positions[t] > max_positions - 1 ? max_positions - 1 : positions[t]);
        for (int c = 0; c < d; ++c)
            out[t * d + c] = c < rotary_dim ? rotated_bias(b, table + p * rotary_dim, c, rotary_dim, gptj != 0) : b[c];
    }
}
extern "C" void terms(const float* x, int n, float scale, float* out) {
    for (int i = 0; i < n; ++i) rope_term(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3], scale, out[2 * i], out[2 * i + 1]);
}
""")
    # contraction as HIP compiles (fast, honoring pragmas) on a host with FMA
    return host_library(tmp_path_factory.mktemp("rope"), text, ["-ffp-contract=fast-honor-pragmas", "-march=native"])


@pytest.mark.parametrize("style, rotary_dim", [("neox", 128), ("gptj", 64)])
def test_writer_rotated_bias_matches_the_host_model(host_rope, style, rotary_dim):
    from qattn.formats.decode.rope import RoPE, rotated_bias

    rng = np.random.default_rng(9)
    rope = RoPE(theta=1e6, rotary_dim=rotary_dim, style=style).resolved(128, 4096)
    table = rope.table()
    b = (rng.standard_normal((1, 128)) * 30).astype(np.float32)
    positions = np.concatenate([rng.integers(0, 4096, 300), [-3, 0, 4095, 9000]]).astype(np.int64)
    got = np.zeros((positions.size, 128), np.float32)
    host_rope.bias(_ptr(b), _ptr(table.view(np.uint16)), _ptr(positions), ctypes.c_int(positions.size), ctypes.c_int(128),
                   ctypes.c_int(rotary_dim), ctypes.c_int(rope.gptj), ctypes.c_int(rope.max_positions), _ptr(got))
    want = rotated_bias(b, rope, table, positions)[:, 0]
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_pair_terms_round_each_product(host_rope):
    """u = fl(fl(fl(q_a b_a) + fl(q_z b_z)) s), w = fl(fl(fl(q_z b_a) - fl(q_a b_z)) s): the CUDA kernel's order."""
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((5000, 4)) * [3, 3, 40, 40]).astype(np.float32)
    scale = np.float32(0.12751743)
    got = np.zeros((5000, 2), np.float32)
    host_rope.terms(_ptr(np.ascontiguousarray(x)), ctypes.c_int(5000), ctypes.c_float(scale), _ptr(got))
    qa, qz, ba, bz = x.T
    u = ((qa * ba).astype(np.float32) + (qz * bz).astype(np.float32)).astype(np.float32) * scale
    w = ((qz * ba).astype(np.float32) - (qa * bz).astype(np.float32)).astype(np.float32) * scale
    np.testing.assert_array_equal(got.view(np.uint32), np.stack([u, w], 1).astype(np.float32).view(np.uint32))


def test_writer_zeroes_its_block_sums_before_any_group_adds():
    """The page-mean writer's LDS sums are zeroed, then a barrier, then the groups' atomics (a group that ran
    ahead would otherwise add onto sums another thread has not zeroed yet)."""
    source = render(_spec("i8-i8", "gfx1100", "transform", MEAN))
    body = source[source.index("QATTN_DEVICE void write_body("):]
    zero, add = body.index("block_sums[i] = 0ull"), body.index("__hip_atomic_fetch_add(block_sums")
    assert "block_sync();" in body[zero:add]
