"""HIP decode over a pre-RoPE cache (k_rope "pre": the cache holds k_pre - b), compiled offline with clang-19: the
transform path turns each key's codes by R_p as it widens them into LDS and adds q·R_p b per key on the fp16 op,
on every target; the writer is the plain pre-bias residual one. The K tile's load, cut from the rendered source and
run on the host, gives decode.rope.rotated_codes bit for bit (int8 and e4m3 codes, fp16 and bf16 operands, neox
and gptj pairs, partial rotary, positions past the table, keys past the end)."""
import ctypes

import ml_dtypes
import numpy as np
import pytest

from qattn.engine.compile import resource_remarks
from qattn.engine.render import entry_name, render
from qattn.engine.spec import KernelSpec
from qattn.formats.decode.rope import RoPE, rotated_codes

from hip_offline import MATRIX_OP, WAVE, built, cut_function, host_library, needs_clang, op_count, query_types

pytestmark = needs_clang

PRE = {"k_rope": "pre"}
WRITERS = [f"_write_{t}_{s}" for t in ("f16", "bf16") for s in ("i32", "i64")]


def _spec(fmt, arch, d=128, page=16, scale="token") -> KernelSpec:
    return KernelSpec(kind="decode", recipe=fmt, head_dim=d, backend="hip", arch=arch,
                      options={"page_size": page, "scale_mode": scale, **PRE})


def test_pre_rope_takes_the_transform_path_alone():
    assert _spec("i8-i8", "gfx942").name.endswith("_krope-pre_transform_gfx942")
    for options, words in (({"qk": "int8"}, "^qk: the pre-RoPE residual K turns each key's codes on chip"),
                           ({"qk": "fp8"}, "^qk: the pre-RoPE residual K turns each key's codes on chip"),
                           ({"k_mean": "page"}, "^k_mean: the pre-RoPE residual K takes k_mean 'off'")):
        with pytest.raises(ValueError, match=words):
            KernelSpec(kind="decode", recipe="e4m3-e4m3" if options.get("qk") == "fp8" else "i8-i8", backend="hip",
                       arch="gfx942", options={**PRE, **options})


@pytest.mark.parametrize("arch, fmt, d", [("gfx90a", "i8-i8", 128), ("gfx942", "e4m3-e4m3", 64),
                                          ("gfx1100", "e4m3-f16", 128), ("gfx1201", "i8-bf16", 64)])
def test_pre_rope_kernels_turn_the_codes_and_add_the_term(arch, fmt, d):
    """The codes turned where they are widened; per (query tile, key tile): the QK product on the query type's
    op, the two fp16 products of q·R_p b a 16-dim step (hi, lo; the loops rolled) and PV. The writer takes no
    positions (it stores k_pre - b). No scratch anywhere."""
    spec = _spec(fmt, arch, d=d)
    source = render(spec)
    assert "x = c < rotary_dim ? rotated_code<T>(krow, c," in source and "rope_sum[mt][nt][i]" in source
    assert "rotated_bias(" not in source and "positions" not in source.split("write_body(")[1].split(")")[0]
    binary, funcs = built(spec)
    mt, nt, dt = WAVE[arch] // 32, spec.tile.block_n // 16, d // 16
    remarks = resource_remarks(binary.log)
    for t in query_types(fmt):
        main = funcs[entry_name(spec) + "_" + t]
        f16_ops, bf16_ops = op_count(MATRIX_OP["f16", arch], main), op_count(MATRIX_OP["bf16", arch], main)
        own = mt * nt * (dt + 1)  # QK (one rolled 16-channel step) and PV on the query type's op
        assert (f16_ops, bf16_ops) == ((own + 2 * mt * nt, 0) if t == "f16" else (2 * mt * nt, own)), t
        others = [op for (kind, a), op in MATRIX_OP.items() if a == arch and kind not in ("f16", "bf16")]
        assert not any(op_count(op, main) for op in others), t
        assert remarks[entry_name(spec) + "_" + t]["ScratchSize"] == 0
    for suffix in WRITERS + [f"_merge_{t}" for t in query_types(fmt)]:
        assert remarks[entry_name(spec) + suffix]["ScratchSize"] == 0, suffix


# ---- the K tile's load, run on the host ------------------------------------------------------------------

D, PAGE, BN, HKV = 64, 16, 32, 2


@pytest.fixture(scope="module", params=["i8-i8", "e4m3-e4m3"])
def host_tile(request, tmp_path_factory):
    fmt = request.param
    source = render(_spec(fmt, "gfx1100", d=D, page=PAGE))
    parts = [cut_function(source, signature) for signature in (
        "template <int CODE, class T>\nQATTN_DEVICE T widen(const unsigned char* p, int i)",
        "template <class T>\nQATTN_DEVICE T rotated_code(",
        "template <class T>\nQATTN_DEVICE void load_k_rows(")]
    text = (f"#define QATTN_DEVICE static inline\ntypedef long long i64;\ntypedef unsigned short u16;\n"
            f"typedef _Float16 f16;\nconstexpr int D = {D}, PAGE = {PAGE}, BN = {BN}, QROW = D + 8, THREADS = 1;\n"
            f"constexpr int K_CODE = {2 if fmt.startswith('i8') else 1}, K_BYTES = 1;\n" + "".join(parts) + """
#define ROWS(T, name) extern "C" void name(u16* Ks, const unsigned char* pool, const int* table, int kv_head, int Hkv, \\
        int k0, int end, const u16* rope, int rotary_dim, int gptj, int max_positions) { \\
    load_k_rows<T>(reinterpret_cast<T*>(Ks), pool, table, kv_head, Hkv, k0, end, 0, rope, rotary_dim, gptj, max_positions); }
ROWS(f16, rows_f16)
ROWS(__bf16, rows_bf16)
""")
    # contraction as HIP compiles (fast, honoring pragmas); a code times an fp16 cos or sin is exact in fp32 anyway
    flags = ["-std=c++17", "-ffp-contract=fast-honor-pragmas", "-march=native"]
    return fmt, host_library(tmp_path_factory.mktemp("pre_rope"), text, flags)


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("style, rotary_dim, max_positions", [("neox", 64, 4096), ("gptj", 32, 40), ("neox", 32, 70)])
@pytest.mark.parametrize("half", ["f16", "bf16"])
def test_k_tile_load_turns_the_codes_as_the_host_model(host_tile, style, rotary_dim, max_positions, half):
    fmt, lib = host_tile
    rng = np.random.default_rng(rotary_dim + max_positions)
    length, pages = 83, 12
    table = rng.permutation(pages)[: -(-length // PAGE)].astype(np.int32)  # the sequence's pages, shuffled
    if fmt.startswith("i8"):
        codes = rng.integers(-127, 128, (length, D)).astype(np.int8)
    else:
        codes = (rng.standard_normal((length, D)) * 60).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    values, pool_bytes = codes.astype(np.float32), codes.view(np.uint8)
    kv_head = 1
    pool = rng.integers(0, 256, (pages, HKV, PAGE, D)).astype(np.uint8)  # other heads' and pages' bytes: noise
    for key in range(length):
        pool[table[key // PAGE], kv_head, key % PAGE] = pool_bytes[key]
    rope = RoPE(theta=1e4, rotary_dim=rotary_dim, style=style, max_positions=max_positions).resolved(D, 1 << 20)
    rope_table = rope.table()
    dtype = np.float16 if half == "f16" else ml_dtypes.bfloat16
    want = rotated_codes(values[None], rope, rope_table, dtype)[0].astype(dtype).view(np.uint16)
    for k0 in (0, BN, 2 * BN):  # the last tile runs past the sequence's end
        got = np.full((BN, D + 8), 0xFFFF, np.uint16)
        ints = (kv_head, HKV, k0, length)
        getattr(lib, f"rows_{half}")(_ptr(got), _ptr(pool), _ptr(table), *map(ctypes.c_int, ints),
                                     _ptr(rope_table.view(np.uint16)), *map(ctypes.c_int, (rotary_dim, rope.gptj, max_positions)))
        live = min(BN, length - k0)
        np.testing.assert_array_equal(got[:live, :D], want[k0:k0 + live])
        assert (got[live:, :D] == 0).all() and (got[:, D:] == 0xFFFF).all()  # zeros past the end; padding untouched
