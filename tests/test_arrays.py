"""Host arrays handed to a GPU call: refused on the CPU, before any GPU work, naming the argument and what to
do instead."""
import numpy as np
import pytest

import qattn
from qattn.engine.arrays import as_device_array


@pytest.mark.parametrize("value,kind", [(np.ones((1, 2, 8, 64), np.float16), "numpy.ndarray on a non-CUDA device"),
                                        ([[1.0, 2.0]], "builtins.list")])
def test_host_arrays_are_refused_with_what_to_do(value, kind):
    with pytest.raises(TypeError) as err:
        as_device_array(value, "k")
    text = str(err.value)
    assert text.startswith("k: expected a CUDA array") and kind in text
    assert "cupy.asarray(x)" in text and "qattn.check.emulate.emulate(format, q, k, v)" in text


def test_attention_on_numpy_names_q_and_the_cpu_emulator():
    q = np.random.default_rng().standard_normal((1, 2, 24, 64)).astype(np.float16)
    with pytest.raises(TypeError, match=r"^q: expected a CUDA array, got a numpy\.ndarray .*emulate\(format, q, k, v\)"):
        qattn.attention(q, q, q, format="f16")
