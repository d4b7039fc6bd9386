"""The CUDA decode kernel's V stage: V rows as the cache holds them ([page][kv head][token][D], a token's row
contiguous), staged by key with 16-byte units swizzled, and the PV operand V^T read from them by transposed 8x8
loads (ldmatrix .trans). The stage's placement and the lanes' load addresses are cut from the rendered source and
run on the host; the loads are modelled as the PTX ISA defines them (lane 8m + r addresses row r of matrix m;
thread (g, t) receives elements [2t][g] and [2t + 1][g] of each matrix), an 8-bit V's byte pairs widened crossed
(codes 0, 2 and 1, 3), and what each lane then holds is checked against the A operand of O^T += V^T P^T."""

import re

import numpy as np
import pytest

from qattn.engine.render import render
from qattn.engine.spec import KernelSpec
from qattn.engine.tile import Tile

from hip_offline import cut_function, host_library, needs_clang


def _constant(source: str, name: str) -> str:
    m = re.search(rf"^constexpr int {name} = [^\n]*\n", source, re.M)
    assert m, name
    return m.group(0)


def _stage_library(tmp_path, fmt: str, head_dim: int, warps: int):
    spec = KernelSpec(kind="decode", recipe=fmt, head_dim=head_dim, arch="sm_90a", options={"page_size": 32},
                      tile=Tile(8, 16 * warps, warps, 2))
    source = render(spec)
    vb = 2 if fmt.endswith("f16") else 1
    text = (f"#define QATTN_DEVICE static inline\nstatic constexpr int D = {head_dim}, VB = {vb}, "
            f"THREADS = {32 * warps};\n"
            + "".join(_constant(source, name) for name in ("V_ROW", "V_JUMP", "V_PITCH"))
            + "template <int ROW, int U, int LINES = 4>\n"
            + cut_function(source, "QATTN_DEVICE constexpr int swizzle_key(int row)")
            + "template <int ROW, int U, int PITCH = ROW, int LINES = 4>\n"
            + cut_function(source, "QATTN_DEVICE constexpr int swizzled(int row, int at)")
            + "".join(cut_function(source, f"QATTN_DEVICE constexpr int {name}") for name in
                      ("v_swizzled(int row, int at)", "v_read_at(int lane, int n)", "o_channel(int i, int g, int hi)"))
            + """
extern "C" int place(int row, int at) { return v_swizzled(row, at); }
extern "C" int read_at(int lane, int n) { return v_read_at(lane, n); }
extern "C" int channel(int i, int g, int hi) { return o_channel(i, g, hi); }
extern "C" int pitch() { return V_PITCH; }
""")
    return host_library(tmp_path, text, []), vb


@needs_clang
@pytest.mark.parametrize("fmt", ["i8-i8", "f16-f16"])
@pytest.mark.parametrize("head_dim, warps", [(64, 2), (128, 2), (128, 4), (256, 2), (256, 4)])
def test_v_stage_loads_give_each_lane_its_pv_operand(tmp_path, fmt, head_dim, warps):
    lib, vb = _stage_library(tmp_path, fmt, head_dim, warps)
    keys, row, pitch = 16 * warps, head_dim * vb, lib.pitch()
    # the stage as the copies fill it: byte `at` of key r's row at place(r, at), 16-byte chunks kept whole
    owner = np.full(keys * pitch, -1, np.int64)  # (key * row + byte) of the V row byte held there
    for r in range(keys):
        for c in range(0, row, 16):
            at = lib.place(r, c)
            assert at % 16 == 0 and at + 16 <= owner.size and (owner[at:at + 16] == -1).all(), (r, c)
            owner[at:at + 16] = r * row + c + np.arange(16)
    assert (owner >= 0).sum() == keys * row  # every byte of every row staged once

    def element(label):  # the (key, channel) of a staged byte pair's first byte
        key, byte = divmod(int(label), row)
        return key, byte // vb

    channels = sorted(lib.channel(i, g, hi) for i in range(head_dim // 16) for g in range(8) for hi in range(2))
    assert channels == list(range(head_dim))  # O^T rows are every channel once
    for warp in range(warps):
        base = 16 * warp * pitch
        for n in range(row // 32):  # a warp's loads, as the kernel issues them
            addr = [base + lib.read_at(lane, n % 4) + n // 4 * 128 for lane in range(32)]
            assert all(addr[lane] == base + lib.read_at(lane, n) for lane in range(32))
            for m in range(4):  # each phase: 8 rows on 8 distinct 16-byte bank groups
                assert len({addr[8 * m + r] // 16 % 8 for r in range(8)}) == 8, (warp, n, m)
            for g in range(8):
                for t in range(4):
                    # register m: matrix m's elements [2t][g] (low half) and [2t + 1][g] (high half), 2 bytes each
                    regs = [[owner[addr[8 * m + 2 * t + k] + 2 * g + b] for k in range(2) for b in range(2)]
                            for m in range(4)]
                    if vb == 2:  # m-tile n: a[m] = (key 2t + 8 (m / 2) + (0, 1), channel of row g + 8 (m % 2))
                        tiles = {n: [(regs[m][0], regs[m][2]) for m in range(4)]}
                    else:  # m-tiles 2n, 2n + 1 from registers (0, 1) and (2, 3); crossed: codes 0, 2 and 1, 3
                        tiles = {2 * n + h: [(regs[2 * h + m // 2][m % 2], regs[2 * h + m // 2][2 + m % 2])
                                             for m in range(4)] for h in range(2)}
                    for i, a in tiles.items():
                        for m, pair in enumerate(a):  # A[row][k]: rows g, g + 8, k 2t, 2t + 1 (+ 8)
                            ch = lib.channel(i, g, m % 2)
                            want = [(16 * warp + 2 * t + 8 * (m // 2) + k, ch) for k in range(2)]
                            assert [element(label) for label in pair] == want, (warp, n, g, t, i, m)
                            if vb == 2:  # a 16-bit element's two bytes come together
                                assert all(int(label) % 2 == 0 for label in pair)
