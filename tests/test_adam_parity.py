"""offload_adamw gives optax.adamw's numbers, whatever share of state is offloaded and wherever it updates."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxoffload
from tests.helpers import max_rel_diff, mixed_params, moment_kinds, train

FRACTIONS = [0.0, 0.25, 0.5, 1.0]
MODES = ["host", "device"]
STEPS = 20
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, STEPS)


def adamw_pair(fraction, update_on, **kwargs):
  """offload_adamw, with device streaming cut into several chunks per leaf, and optax.adamw."""
  ours = optax.chain(
      jaxoffload.scale_by_offloaded_adam(offload_fraction=fraction, update_on=update_on,
                                         chunk_bytes=1024, **kwargs),
      optax.add_decayed_weights(1e-2),
      optax.scale_by_learning_rate(SCHEDULE),
  )
  return ours, optax.adamw(SCHEDULE, weight_decay=1e-2, **kwargs)


def test_offload_adamw_is_the_chain_above():
  params = mixed_params()
  got, _, _ = train(jaxoffload.offload_adamw(SCHEDULE, weight_decay=1e-2, offload_fraction=0.5),
                    params, STEPS)
  want, _, _ = train(adamw_pair(0.5, "host")[0], params, STEPS)
  assert max_rel_diff(got, want) == 0.0


# The parity table: per kind of state, its parameters' dtype, the optimizer's keywords, the
# fractions tried and the largest relative difference from optax.adamw allowed.
PARITY = {
    "float32": (jnp.float32, {}, FRACTIONS, 1e-5),
    # Bitwise equal on CPU; other backends may round one bfloat16 step (2**-8) apart.
    "bfloat16-params": (jnp.bfloat16, {}, [0.5, 1.0], 2**-7),
    "bfloat16-mu": (jnp.float32, {"mu_dtype": jnp.bfloat16}, [0.5], 1e-5),
}
CASES = [pytest.param(kind, fraction, update_on, id=f"{kind}-{fraction}-{update_on}")
         for kind, (_, _, fractions, _) in PARITY.items()
         for fraction in fractions for update_on in MODES]


@pytest.mark.parametrize("kind, fraction, update_on", CASES)
def test_matches_optax(kind, fraction, update_on):
  dtype, kwargs, _, tolerance = PARITY[kind]
  ours, ref = adamw_pair(fraction, update_on, **kwargs)
  params = mixed_params(dtype)
  got, got_state, _ = train(ours, params, STEPS)
  want, _, _ = train(ref, params, STEPS)
  mu_dtype = kwargs.get("mu_dtype", dtype)
  assert {x.dtype for x in jax.tree.leaves(got_state[0].mu)} == {jnp.dtype(mu_dtype)}
  if mu_dtype != dtype and update_on == "host" and jax.default_backend() != "cpu":
    # Rounding mu to bfloat16 turns a last-bit float32 difference between the host CPU's
    # and a GPU's arithmetic into a bfloat16 step; on one backend they agree.
    tolerance = 1e-3
  assert max_rel_diff(got, want) <= tolerance


def test_host_and_device_updates_agree():
  params = mixed_params()
  on_host, _, _ = train(adamw_pair(1.0, "host")[0], params, STEPS)
  on_device, _, _ = train(adamw_pair(1.0, "device")[0], params, STEPS)
  assert max_rel_diff(on_host, on_device) <= 1e-6


def test_eager_matches_jit():
  ours, ref = adamw_pair(0.5, "host")
  params = mixed_params()
  got, _, _ = train(ours, params, 3, jit=False)
  want, _, _ = train(ref, params, 3)
  assert max_rel_diff(got, want) <= 1e-5


@pytest.mark.parametrize("overlap", [False, True], ids=["one-piece-at-a-time", "overlapped"])
def test_streaming_in_many_chunks_matches_whole_leaves(overlap):
  params = mixed_params()
  chunked = jaxoffload.scale_by_offloaded_adam(update_on="device", chunk_bytes=64,
                                               overlap_transfers=overlap)
  whole = jaxoffload.scale_by_offloaded_adam(update_on="device", chunk_bytes=2**30)
  got, _, _ = train(chunked, params, 5)
  want, _, _ = train(whole, params, 5)
  assert max_rel_diff(got, want) <= 1e-6


def test_overlapped_streaming_matches_optax():
  params = mixed_params()
  ours = optax.chain(
      jaxoffload.scale_by_offloaded_adam(update_on="device", chunk_bytes=1024,
                                         overlap_transfers=True),
      optax.add_decayed_weights(1e-2),
      optax.scale_by_learning_rate(SCHEDULE),
  )
  got, _, _ = train(ours, params, STEPS)
  want, _, _ = train(optax.adamw(SCHEDULE, weight_decay=1e-2), params, STEPS)
  assert max_rel_diff(got, want) <= 1e-5


def test_overlap_needs_device_streaming():
  with pytest.raises(ValueError, match="overlap_transfers=True streams through the device: it "
                                       "needs update_on='device', got 'host'"):
    jaxoffload.scale_by_offloaded_adam(update_on="host", overlap_transfers=True)


@pytest.mark.parametrize("update_on", [pytest.param("host", marks=pytest.mark.slow), "device"])
def test_bfloat16_moments_rounded_stochastically_track_float32(update_on):
  ours = optax.chain(
      jaxoffload.scale_by_offloaded_adam(offload_fraction=0.5, update_on=update_on,
                                         chunk_bytes=1024, mu_dtype=jnp.bfloat16,
                                         nu_dtype=jnp.bfloat16, stochastic_rounding=True),
      optax.add_decayed_weights(1e-2), optax.scale_by_learning_rate(SCHEDULE))
  params = mixed_params()
  got, got_state, _ = train(ours, params, STEPS)
  want, _, _ = train(optax.adamw(SCHEDULE, weight_decay=1e-2), params, STEPS)
  adam = got_state[0]
  assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
  assert moment_kinds(adam) == moment_kinds(train(adamw_pair(0.5, update_on)[0], params, 1)[1][0])
  assert 0 < max_rel_diff(got, want) <= 2e-3
