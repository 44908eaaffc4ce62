"""8-bit blockwise moments: the format's error bound, layout, and the host's encoding of it."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxoffload.host import adam
from jaxoffload.optim import blockwise


def moments(shape, signed, seed=0):
  rng = np.random.default_rng(seed)
  # Magnitudes spread over decades within each block, as Adam's moments are.
  x = rng.standard_normal(shape) * np.exp(2 * rng.standard_normal(shape))
  return (x if signed else x * x).astype(np.float32)


@pytest.mark.parametrize("signed, bound", [(True, 1 / 127), (False, 2 / 255)])
def test_each_element_is_within_half_a_level_of_its_block_scale(signed, bound):
  x = moments((6, 700), signed)  # Rows of two whole blocks and a partial one.
  codes, scales = blockwise.encode(jnp.asarray(x), signed=signed)
  assert codes.dtype == blockwise.code_dtype(signed) and codes.shape == x.shape
  assert scales.shape == blockwise.scales_shape(x.shape) == (6, 3)
  blocks = [x[:, :256], x[:, 256:512], x[:, 512:]]
  np.testing.assert_array_equal(
      np.asarray(scales), np.stack([np.abs(b).max(axis=1) for b in blocks], axis=1))
  error = np.abs(np.asarray(blockwise.decode(codes, scales, signed=signed), np.float64) - x)
  per_element_scale = np.repeat(np.asarray(scales), 256, axis=1)[:, :700]
  # Half a level's step at the top of the range, where the steps are widest.
  assert np.max(error / per_element_scale) <= bound
  # The largest element of each block is stored exactly.
  top = np.abs(x) == per_element_scale
  np.testing.assert_array_equal(np.asarray(blockwise.decode(codes, scales, signed=signed))[top],
                                x[top])


def test_a_zero_block_and_a_leaf_of_one_row_decode_to_themselves():
  x = np.zeros((3, 10), np.float32)
  x[2] = np.linspace(-1, 1, 10)
  codes, scales = blockwise.encode(jnp.asarray(x), signed=True)
  decoded = np.asarray(blockwise.decode(codes, scales, signed=True))
  np.testing.assert_array_equal(decoded[:2], 0.0)
  assert blockwise.scales_shape((300,)) == (1, 2) and blockwise.scales_shape(()) == (1, 1)


@pytest.mark.parametrize("signed", [True, False])
def test_the_host_encodes_and_decodes_as_jax_does_and_a_round_trip_is_exact(signed):
  x = moments((4, 33, 40), signed, seed=1)  # A stack of 4 layers: a row each.
  host = adam.CodedMoment.zeros(x.shape, signed=signed)
  host.assign(x)
  codes, scales = blockwise.encode(jnp.asarray(x), signed=signed)
  np.testing.assert_array_equal(host.codes, np.asarray(codes))
  np.testing.assert_array_equal(host.scales, np.asarray(scales))
  np.testing.assert_array_equal(host.decode(), np.asarray(blockwise.decode(codes, scales,
                                                                          signed=signed)))
  # A checkpoint holds the decoded float32 moments: read back, they encode to the same codes.
  again = adam.CodedMoment.zeros(x.shape, signed=signed)
  again.assign(host.decode())
  np.testing.assert_array_equal(again.codes, host.codes)
  np.testing.assert_array_equal(again.scales, host.scales)
  # Layer 2 is row 2: its own codes and scales.
  np.testing.assert_array_equal(host[2].decode(), host.decode()[2])
  assert 1 < blockwise.bytes_per_element(x.shape) < 1.1
