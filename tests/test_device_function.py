"""The kernel-argument packing of DeviceFunction (CPU): the C layout of a parameter list, and the
refusal of untyped scalars. Launches themselves run in every GPU test."""
import struct

import numpy as np
import pytest

from qattn.runtime.device_function import _offsets, pack_args


def test_offsets_follow_c_alignment():
    # int32, int64, float32, int32, uintp: the int64 and the pointer start on 8-byte boundaries.
    fmt, values = pack_args((np.int32(7), np.int64(-3), np.float32(1.5), np.int32(2), np.uintp(0xdead0)))
    assert fmt == "iqfiQ"
    assert _offsets(fmt).tolist() == [0, 8, 16, 20, 24]
    raw = struct.pack("@" + fmt, *values)
    assert len(raw) == 32
    assert struct.unpack_from("<q", raw, 8)[0] == -3
    assert struct.unpack_from("<f", raw, 16)[0] == 1.5
    assert struct.unpack_from("<Q", raw, 24)[0] == 0xdead0


@pytest.mark.parametrize("bad", [3, 2.5, True, np.float64(1.0), np.int16(1), None])
def test_untyped_scalars_are_refused(bad):
    with pytest.raises(TypeError, match=r"kernel argument 1: expected a CuPy array or a NumPy int32"):
        pack_args((np.int32(1), bad))
