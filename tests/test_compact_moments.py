"""offload_adamw with compact moments: near float64 AdamW on the 8-device mesh, and the host kernel's
update for the same storage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxoffload
from jaxoffload.host import adam
from jaxoffload.optim import blockwise
from tests.helpers import float64_adamw, grads_at, train

HYPER = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
STEPS = 6
# A number, not a schedule: a schedule's step count would live on one device of the mesh.
LEARNING_RATE = 2e-3
# Rows of four blocks (one short), split along rows, along columns, and a vector.
SPECS = {"rows": ((8, 1000), P("fsdp", None)), "columns": ((48, 520), P(None, "tensor")),
         "vector": ((1000,), P("fsdp"))}
# Each dtype's largest distance from float64 AdamW, as a share of how far the weights moved.
BOUNDS = {"float32": 1e-4, "bfloat16": 1e-2, "int8": 3e-2}


def sharded_params():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
  keys = iter(jax.random.split(jax.random.PRNGKey(0), len(SPECS)))
  return {name: jax.device_put(jax.random.normal(next(keys), shape), NamedSharding(mesh, spec))
          for name, (shape, spec) in SPECS.items()}


def compact_adamw(dtype, fraction):
  return jaxoffload.offload_adamw(LEARNING_RATE, **HYPER, offload_fraction=fraction, mu_dtype=dtype,
                                  nu_dtype=dtype, stochastic_rounding=dtype == "bfloat16")


@pytest.mark.parametrize("fraction", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16",
                                   "int8"])
def test_compact_moments_train_near_float64_adamw_on_a_mesh(dtype, fraction):
  params = sharded_params()
  got, state, _ = train(compact_adamw(dtype, fraction), params, STEPS)
  grads = [grads_at(params, step) for step in range(STEPS)]
  for name, param in params.items():
    exact = float64_adamw(param, [g[name] for g in grads], [LEARNING_RATE] * STEPS, **HYPER)
    moved = np.max(np.abs(np.asarray(param, np.float64) - exact))
    assert np.max(np.abs(np.asarray(got[name], np.float64) - exact)) / moved < BOUNDS[dtype]
    assert got[name].sharding.is_equivalent_to(param.sharding, param.ndim)
  if dtype == "int8":
    kind = "pinned_host" if fraction else "device"
    for moment, code_dtype in ((state[0].mu, jnp.int8), (state[0].nu, jnp.uint8)):
      for name, (shape, spec) in SPECS.items():
        codes, scales = moment[name]
        assert (codes.dtype, codes.shape, codes.sharding.memory_kind) == (code_dtype, shape, kind)
        assert scales.shape == blockwise.scales_shape(shape) and scales.sharding.memory_kind == kind
        rows = spec[0] if len(shape) > 1 else None
        assert scales.sharding.spec == P(rows, None)


@pytest.mark.parametrize("fraction", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_eight_bit_moments_update_as_the_host_kernel_updates_them(fraction):
  params = {"w": jax.random.normal(jax.random.PRNGKey(1), (16, 600))}
  got, state, _ = train(compact_adamw("int8", fraction), params, STEPS)
  weights = np.array(params["w"])
  mu = adam.CodedMoment.zeros(weights.shape, signed=True)
  nu = adam.CodedMoment.zeros(weights.shape, signed=False)
  for count in range(1, STEPS + 1):
    grad = np.asarray(grads_at(params, count - 1)["w"])
    adam.adamw_update(weights, grad, mu, nu, learning_rate=LEARNING_RATE, count=count,
                           **HYPER)
  # The same codes; the weights and scales as close as float32 arithmetic in another order.
  np.testing.assert_allclose(np.asarray(got["w"]), weights, rtol=0, atol=1e-6)
  for moment, host in ((state[0].mu["w"], mu), (state[0].nu["w"], nu)):
    np.testing.assert_array_equal(np.asarray(moment.codes), host.codes)
    np.testing.assert_allclose(np.asarray(moment.scales), host.scales, rtol=1e-6)


def test_eight_bit_moments_cannot_stream_through_the_device():
  with pytest.raises(ValueError, match="mu_dtype=int8 keeps 8-bit blocks, which update where "
                                       "they live: offloaded ones on the host; use "
                                       "update_on='host', got 'device'"):
    jaxoffload.scale_by_offloaded_adam(mu_dtype=jnp.int8, update_on="device").init(
        {"w": jnp.zeros(4)})
  # Where none is offloaded, none streams.
  opt = jaxoffload.scale_by_offloaded_adam(mu_dtype=jnp.int8, update_on="device",
                                           offload_fraction=0.0)
  assert opt.init({"w": jnp.zeros(4)}).mu["w"].codes.dtype == jnp.int8


def test_a_moment_dtype_that_is_neither_floating_nor_int8_is_named():
  with pytest.raises(ValueError, match="nu_dtype must be a floating dtype or int8 "
                                       r"\(8-bit blocks\), got int32"):
    jaxoffload.scale_by_offloaded_adam(nu_dtype=jnp.int32)
