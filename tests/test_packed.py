"""PackedLaunch lays out kernel parameters as the CUDA ABI wants them and patches only the pointers
(CPU: the driver call is intercepted and the parameter buffer read back)."""
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from qattn.engine.packed import NULL, Blob, PackedLaunch, Pointer

cupy = pytest.importorskip("cupy")


def read_params(params_ptr: int, kinds):
    """The values the driver would copy: params_ptr is a void*[], one entry per parameter."""
    addresses = (ctypes.c_uint64 * len(kinds)).from_address(params_ptr)
    return [ctypes.cast(addresses[i], ctypes.POINTER(kind)).contents.value for i, kind in enumerate(kinds)]


@pytest.fixture
def launches(monkeypatch):
    seen = []

    def fake_launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        seen.append(dict(f=f, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem, stream=stream, params=params))

    monkeypatch.setattr(cupy.cuda.driver, "launchKernel", fake_launch)
    return seen


def test_parameters_are_aligned_and_pointers_patched_per_call(launches):
    rng = np.random.default_rng()
    n32, n64, f32 = int(rng.integers(-2**31, 2**31)), int(rng.integers(-2**62, 2**62)), float(rng.standard_normal())
    base_a, base_b, skip = int(rng.integers(1, 2**40)) * 256, int(rng.integers(1, 2**40)) * 256, 4096 + 16
    launch = PackedLaunch(SimpleNamespace(ptr=0xABC), (7, 3, 2), 256, 1024,
                          (np.int32(n32), Pointer("a"), np.int32(5), np.int64(n64), np.float32(f32), NULL,
                           Pointer("b", skip), np.int32(-1)))
    kinds = (ctypes.c_int32, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_uint64,
             ctypes.c_uint64, ctypes.c_int32)
    for call in range(2):  # the second call must see the new pointers, nothing else changed
        a, b = base_a + call * 512, base_b - call * 256
        launch({"a": a, "b": b}, stream_ptr=77 + call)
        got = launches[-1]
        assert got["f"] == 0xABC and got["grid"] == (7, 3, 2) and got["block"] == (256, 1, 1)
        assert got["smem"] == 1024 and got["stream"] == 77 + call
        values = read_params(got["params"], kinds)
        assert values[:3] == [n32, a, 5] and values[3] == n64 and values[5:] == [0, b + skip, -1]
        assert values[4] == pytest.approx(np.float32(f32), rel=0, abs=0)
        addresses = (ctypes.c_uint64 * len(kinds)).from_address(got["params"])
        offsets = [addresses[i] - addresses[0] for i in range(len(kinds))]
        assert offsets == [0, 8, 16, 24, 32, 40, 48, 56]  # 8-byte values on 8-byte boundaries


def test_blobs_are_aligned_and_written_per_call(launches):
    """128-byte by-value parameters (tensor maps) at 64-byte aligned offsets of a 64-byte aligned
    buffer, their bytes copied in per call; the scalars and pointers around them as before."""
    rng = np.random.default_rng()
    n32, f32 = int(rng.integers(-2**31, 2**31)), float(rng.standard_normal())
    launch = PackedLaunch(SimpleNamespace(ptr=0xB10B), (3, 2, 1), 384, 4096,
                          (Pointer("q"), np.int32(n32), np.float32(f32), Blob("k_map"), np.int32(7),
                           Blob("v_map", 128, 64)))
    for call in range(3):
        k_map, v_map = rng.bytes(128), rng.bytes(128)
        launch({"q": 4096 * (call + 1), "k_map": k_map, "v_map": v_map}, stream_ptr=call)
        params = launches[-1]["params"]
        addresses = list((ctypes.c_uint64 * 6).from_address(params))
        offsets = [a - addresses[0] for a in addresses]
        assert offsets == [0, 8, 12, 64, 192, 256]  # k_map after the float, padded to 64; v_map likewise
        assert all(a % 64 == 0 for a in (addresses[0], addresses[3], addresses[5]))
        assert ctypes.string_at(addresses[3], 128) == k_map and ctypes.string_at(addresses[5], 128) == v_map
        got = read_params(params, (ctypes.c_uint64, ctypes.c_int32, ctypes.c_float))
        assert got[:2] == [4096 * (call + 1), n32] and got[2] == pytest.approx(np.float32(f32), rel=0, abs=0)
        assert ctypes.c_int32.from_address(addresses[4]).value == 7


def test_a_blob_of_the_wrong_size_fails_before_the_launch(launches):
    launch = PackedLaunch(SimpleNamespace(ptr=1), (1, 1, 1), 32, 0, (Blob("m"),))
    with pytest.raises(ValueError, match="m: expected 128 bytes, got 64"):
        launch({"m": bytes(64)}, 0)
    with pytest.raises(KeyError):
        launch({}, 0)
    assert launches == []


def test_bad_launch_shapes_are_refused():
    fn = SimpleNamespace(ptr=1)
    with pytest.raises(ValueError, match="grid"):
        PackedLaunch(fn, (1, 1), 32, 0, ())
    with pytest.raises(ValueError, match="every dimension"):
        PackedLaunch(fn, (0, 1, 1), 32, 0, ())


def test_a_missing_pointer_name_fails_before_the_launch(launches):
    launch = PackedLaunch(SimpleNamespace(ptr=1), (1, 1, 1), 32, 0, (Pointer("q"),))
    with pytest.raises(KeyError):
        launch({}, 0)
    assert launches == []


def test_a_programmatic_launch_passes_the_attribute_and_the_same_parameters(monkeypatch, launches):
    from qattn.engine import packed

    seen = []

    def fake_ex(config_ref, function, params, extra):
        config = config_ref._obj
        attr = config.attrs[0]
        seen.append(dict(grid=tuple(config.grid), block=tuple(config.block), smem=config.shared_mem,
                         stream=config.stream, attrs=config.num_attrs, attr=(attr.id, attr.value[0]), f=function,
                         params=params, extra=extra))
        return 0

    monkeypatch.setattr(packed, "_launch_kernel_ex", lambda: fake_ex)
    rng = np.random.default_rng()
    n32, base = int(rng.integers(-2**31, 2**31)), int(rng.integers(1, 2**40)) * 256
    launch = PackedLaunch(SimpleNamespace(ptr=0x5EED), (9, 4, 3), 384, 2048, (Pointer("a", 16), np.int32(n32)),
                          programmatic=True)
    assert launch.programmatic
    for call in range(2):
        launch({"a": base + 256 * call}, stream_ptr=1234 + call)
        got = seen[-1]
        assert got["grid"] == (9, 4, 3) and got["block"] == (384, 1, 1) and got["smem"] == 2048
        assert got["stream"] == 1234 + call and got["f"] == 0x5EED and got["extra"] is None
        assert got["attrs"] == 1 and got["attr"] == (packed._PROGRAMMATIC_STREAM_SERIALIZATION, 1)
        assert read_params(got["params"], (ctypes.c_uint64, ctypes.c_int32)) == [base + 256 * call + 16, n32]
    assert launches == []  # never the plain launch


def test_a_cluster_launch_passes_its_dimension_beside_the_programmatic_attribute(monkeypatch, launches):
    from qattn.engine import packed

    seen = []

    def fake_ex(config_ref, function, params, extra):
        config = config_ref._obj
        seen.append([(config.attrs[i].id, tuple(config.attrs[i].value[:3])) for i in range(config.num_attrs)])
        return 0

    monkeypatch.setattr(packed, "_launch_kernel_ex", lambda: fake_ex)
    cluster = int(np.random.default_rng().integers(2, 9))
    for programmatic in (True, False):
        launch = PackedLaunch(SimpleNamespace(ptr=3), (3 * cluster, 5, 2), 64, 0, (), programmatic=programmatic,
                              cluster=cluster)
        assert launch.programmatic == programmatic and launch.cluster == cluster
        launch({}, 0)
        want = [(packed._CLUSTER_DIMENSION, (cluster, 1, 1))]
        if programmatic:
            want.insert(0, (packed._PROGRAMMATIC_STREAM_SERIALIZATION, (1, 0, 0)))
        assert seen[-1] == want
    assert launches == []
    with pytest.raises(ValueError, match="not a multiple of the cluster's"):
        PackedLaunch(SimpleNamespace(ptr=3), (cluster + 1, 1, 1), 64, 0, (), cluster=cluster)
    monkeypatch.setattr(packed, "_launch_kernel_ex", lambda: None)
    with pytest.raises(packed.LaunchError, match="cuLaunchKernelEx"):
        PackedLaunch(SimpleNamespace(ptr=3), (cluster, 1, 1), 64, 0, (), cluster=cluster)


def test_a_programmatic_launch_without_the_driver_entry_is_a_plain_one(monkeypatch, launches):
    from qattn.engine import packed

    monkeypatch.setattr(packed, "_launch_kernel_ex", lambda: None)
    launch = PackedLaunch(SimpleNamespace(ptr=7), (1, 1, 1), 32, 0, (Pointer("a"),), programmatic=True)
    assert not launch.programmatic
    launch({"a": 4096}, 5)
    assert len(launches) == 1 and launches[0]["stream"] == 5


def test_a_failed_programmatic_launch_raises(monkeypatch):
    from qattn.engine import packed

    monkeypatch.setattr(packed, "_launch_kernel_ex", lambda: lambda *args: 1)  # CUDA_ERROR_INVALID_VALUE
    launch = PackedLaunch(SimpleNamespace(ptr=7), (1, 1, 1), 32, 0, (), programmatic=True)
    with pytest.raises(packed.LaunchError, match=r"cuLaunchKernelEx: .*1.*grid \(1, 1, 1\), 32 threads, 0 B"):
        launch({}, 0)


def test_a_failed_plain_launch_names_its_shape(monkeypatch):
    from cupy.cuda import driver

    from qattn.engine import packed

    def refuse(*args):
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE: invalid argument")  # as CuPy's CUDADriverError reads

    monkeypatch.setattr(driver, "launchKernel", refuse)
    launch = PackedLaunch(SimpleNamespace(ptr=7), (4, 2, 1), 256, 222336, ())
    with pytest.raises(packed.LaunchError, match=r"cuLaunchKernel: CUDA_ERROR_INVALID_VALUE.*grid \(4, 2, 1\), "
                                                r"256 threads, 222336 B of dynamic shared memory"):
        launch({}, 0)


def test_max_active_clusters_asks_the_driver_with_the_cluster_attribute(monkeypatch):
    from qattn.engine import packed

    seen = []

    def fake(count, function, config_ref):
        config = config_ref._obj
        seen.append((function, tuple(config.grid), tuple(config.block), config.shared_mem, config.num_attrs,
                     config.attrs[0].id, tuple(config.attrs[0].value[:3])))
        count._obj.value = 62
        return 0

    monkeypatch.setattr(packed, "_max_active_clusters", lambda: fake)
    fn = SimpleNamespace(ptr=0xC0DE)
    assert packed.max_active_clusters(fn, (16, 8, 8), 64, 57216, 8) == 62
    assert seen == [(0xC0DE, (16, 8, 8), (64, 1, 1), 57216, 1, packed._CLUSTER_DIMENSION, (8, 1, 1))]
    assert packed.max_active_clusters(fn, (12, 8, 8), 64, 0, 8) == 0  # x not a multiple of the cluster
    assert packed.max_active_clusters(fn, (8, 8, 8), 64, 0, 1) == 0  # no cluster
    assert len(seen) == 1
    monkeypatch.setattr(packed, "_max_active_clusters", lambda: lambda *args: 1)  # the driver refuses
    assert packed.max_active_clusters(fn, (16, 8, 8), 64, 0, 8) == 0
    monkeypatch.setattr(packed, "_max_active_clusters", lambda: None)  # no such entry
    assert packed.max_active_clusters(fn, (16, 8, 8), 64, 0, 8) == 0
