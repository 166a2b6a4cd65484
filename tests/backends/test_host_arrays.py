"""`dflash_jax._host_arrays`: aligned host buffers that JAX adopts without a copy on a CPU (what
loading a target and packing its kernels rely on to build each weight once)."""
import jax
import numpy as np
import pytest

from dflash_jax import _host_arrays as host_arrays


@pytest.mark.parametrize("shape,dtype", [((7,), np.float32), ((3, 5, 16), np.float32), ((4, 9), np.int32),
                                         ((0,), np.float32)])
def test_empty_is_aligned_and_contiguous(shape, dtype):
    a = host_arrays.empty(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
    assert a.size == 0 or a.ctypes.data % host_arrays.ALIGNMENT == 0


def test_adopt_keeps_the_values_and_shares_the_memory_on_a_cpu():
    a = host_arrays.empty((256, 64), np.float32)
    a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    y = host_arrays.adopt(a)
    np.testing.assert_array_equal(np.asarray(y), a)
    if jax.default_backend() == "cpu":
        assert y.unsafe_buffer_pointer() == a.ctypes.data
    unaligned = np.arange(10, dtype=np.float32)[1:]  # 4 bytes past numpy's alignment: copied, still right
    np.testing.assert_array_equal(np.asarray(host_arrays.adopt(unaligned)), unaligned)
