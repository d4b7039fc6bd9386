"""The paged cache's V^T layout (decode.layout): blocks of 4 slots per (page, kv head). The device functions that
place and read V (the CUDA writer's, the HIP kernel's and writer's, and the HIP kernel's slot-to-key map that orders
its copies) are cut from their rendered sources, run on the host and checked against the Python definition; so is
the CUDA kernel's shared-memory V^T tile, whose swizzle must keep every chunk and put a warp's operand reads on
distinct banks."""

import numpy as np
import pytest

from qattn.engine.fragments import pv_key_slot, pv_slot_key
from qattn.engine.render import render
from qattn.engine.spec import KernelSpec
from qattn.formats.decode import layout

from hip_offline import cut_function, host_library, needs_clang


@pytest.mark.parametrize("page_size, head_dim", [(16, 64), (32, 128), (128, 256)])
def test_tokens_reads_back_what_element_places(page_size, head_dim):
    rng = np.random.default_rng(page_size)
    values = rng.standard_normal((3, 2, page_size, head_dim)).astype(np.float32)
    pieces = np.full((3, 2, page_size * head_dim), np.nan, np.float32)
    offsets, channels = np.meshgrid(np.arange(page_size), np.arange(head_dim), indexing="ij")
    pieces[..., layout.element(layout.slot(offsets), channels, head_dim)] = values
    assert not np.isnan(pieces).any()  # every element placed once
    blocks = pieces.reshape(layout.pool_shape(3, 2, page_size, head_dim, 1))
    np.testing.assert_array_equal(layout.tokens(blocks), values)


def test_a_block_holds_one_lanes_runs_and_a_token_one_element_in_four():
    head_dim = 128
    # slots 4t .. 4t + 3 of a group (lane t's keys 2t, 2t + 1, 2t + 8, 2t + 9) are one block, contiguous per channel
    for t in range(4):
        keys = np.array([2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9])
        at = layout.element(layout.slot(keys), 5, head_dim)
        assert list(at) == list(range(at[0], at[0] + 4)) and at[0] == (t * head_dim + 5) * 4
    at = layout.element(layout.slot(37), np.arange(head_dim), head_dim)
    assert np.all(np.diff(at) == 4) and at[-1] - at[0] < 4 * head_dim


def _host_library(tmp_path, parts, head_dim):
    text = (f"#define QATTN_DEVICE static inline\nstatic constexpr int D = {head_dim};\n" + "".join(parts) + """
extern "C" int element(int off, int d) { return vt_element(SLOT(off), d); }
""")
    return host_library(tmp_path, text, [])


@needs_clang
@pytest.mark.parametrize("backend, arch", [("cuda", "sm_90a"), ("hip", "gfx942")])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_sources_place_v_as_the_layout(tmp_path, backend, arch, head_dim):
    spec = KernelSpec(kind="decode", recipe="i8-i8", head_dim=head_dim, backend=backend, arch=arch,
                      options={"page_size": 64})
    source = render(spec)
    if backend == "cuda":  # the writer's slot of a page offset and element of (slot, channel)
        parts = [cut_function(source, f"QATTN_DEVICE constexpr int {name}") for name in
                 ("vt_position(int key)", "vt_slot(int off)", "vt_element(int slot, int d)")]
        parts.insert(0, "#define SLOT(off) vt_slot(off)\n")
    else:  # the kernel's and writer's group slot of a key, its inverse (the kernel's copy order) and element
        parts = [cut_function(source, f"QATTN_DEVICE int {name}") for name in
                 ("group_slot(int k)", "slot_key(int s)", "vt_element(int slot, int d)")]
        parts.insert(0, "#define SLOT(off) (((off) & ~15) + group_slot((off) % 16))\n")
        parts.append('extern "C" int key_of(int s) { return slot_key(s); }\n')
    lib = _host_library(tmp_path, parts, head_dim)
    offsets = np.arange(64)
    assert list(layout.slot(offsets) % 16) == list(pv_key_slot(offsets))
    got = np.array([[lib.element(int(off), d) for d in range(head_dim)] for off in offsets])
    want = layout.element(layout.slot(offsets)[:, None], np.arange(head_dim)[None], head_dim)
    np.testing.assert_array_equal(got, want)
    if backend == "hip":
        assert [lib.key_of(s) for s in range(16)] == list(pv_slot_key(np.arange(16)))


@needs_clang
@pytest.mark.parametrize("fmt, vb", [("i8-i8", 1), ("f16-f16", 2)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_stage_v_tile_reads_on_distinct_banks(tmp_path, fmt, vb, head_dim):
    """The CUDA kernel's V^T stage (the pool's blocks with each 128-byte line's units swizzled by the block's place in
    its group): every 16-byte chunk of a tile lands once, v_lane_at is v_at, and a warp's PV operand reads (lane g, t:
    channel d0 + g of its group's block t; 4 bytes a lane for 8-bit, 8 for 16-bit, a half-warp a phase) fall on 32
    distinct banks."""
    spec = KernelSpec(kind="decode", recipe=fmt, head_dim=head_dim, arch="sm_90a", options={"page_size": 32})
    parts = [cut_function(render(spec), f"QATTN_DEVICE constexpr int {name}") for name in
             ("v_swz(int at)", "v_at(int d, int key)", "v_lane_at(int d0, int g, int key)")]
    text = (f"#define QATTN_DEVICE static inline\nstatic constexpr int D = {head_dim}, VB = {vb}, V_BLOCK = 4 * D * VB, "
            "V_LINE = 128 / (4 * VB);\n" + "".join(parts) + """
extern "C" int swz(int at) { return v_swz(at); }
extern "C" int at(int d, int key) { return v_at(d, key); }
extern "C" int lane_at(int d0, int g, int key) { return v_lane_at(d0, g, key); }
""")
    lib = host_library(tmp_path, text, [])
    tile = 64 * head_dim * vb  # a stage of 64 keys
    chunks = sorted(lib.swz(16 * i) for i in range(tile // 16))
    assert chunks == list(range(0, tile, 16))
    for warp in range(4):
        for d0 in range(0, head_dim, 8):
            lanes = [(g, t) for g in range(8) for t in range(4)]
            addrs = [lib.lane_at(d0, g, 16 * warp + 4 * t) for g, t in lanes]
            assert addrs == [lib.at(d0 + g, 16 * warp + 4 * t) for g, t in lanes]
            for phase in ([range(32)] if vb == 1 else [range(16), range(16, 32)]):
                words = [addrs[lane] // 4 + w for lane in phase for w in range(vb)]
                assert len({word % 32 for word in words}) == 32, (warp, d0, [hex(addrs[lane]) for lane in phase])
