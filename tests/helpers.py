"""Shared test fixtures: a tree of mixed leaf sizes, gradients, a reference training loop, and
the trainer's common overrides."""

import os
import re
import shlex

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxoffload.train.checkpoints import claims

# The trainer's overrides for half the optimizer state on the host kernel.
HOST_KERNEL = ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
               "optimizer.optimizer_offload_update_on=host_kernel"]
QUIET = lambda _: None  # A trainer's log that prints nothing.


def on_tmpfs(directory, options: str, argv: list[str]) -> list[str]:
  """``argv`` as a command that finds ``directory`` (which exists) on a disk of its own, a
  tmpfs mounted there with ``options`` (``"size=4m"``: a small disk; ``"ro"``: a read-only
  one) in a mount namespace of its own, which needs no root. Its status is ``argv``'s;
  after its output, a line ``LISTED`` and the names then in ``directory``, one a line (the
  disk goes with the namespace)."""
  quoted = shlex.quote(str(directory))
  script = (f'mount -t tmpfs -o {options} tmpfs {quoted} || exit 99; "$@"; status=$?; '
            f'echo {LISTED}; ls -A1 {quoted}; exit $status')
  return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "-", *argv]


LISTED = "--- listed:"


def listed(stdout: str) -> list[str]:
  """The names ``on_tmpfs``'s command listed, sorted."""
  return sorted(stdout.split(LISTED + "\n", 1)[1].split())


def checkpoint_entries(directory) -> list[str]:
  """The names in a checkpoint directory that runs have let go of, sorted: its claim file
  (``train.checkpoints.claims``), asserted there and empty (let go), left out."""
  with open(os.path.join(directory, claims.FILE), "rb") as claim:
    assert claim.read() == b"", "a run still claims the directory, or died holding it"
  return sorted(name for name in os.listdir(directory) if name != claims.FILE)


def mixed_params(dtype=jnp.float32, seed=0):
  """Leaves of very different sizes (a scalar to a 2-D table), in nested dicts."""
  shapes = {
      "embed": (96, 32),
      "layer": {"kernel": (32, 64), "bias": (64,), "out": (64, 32)},
      "norm": (32,),
      "scale": (),
  }
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
  return jax.tree.map(lambda s: jax.random.normal(next(keys), s, dtype), shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


def grads_at(params, step):
  """Deterministic pseudo-gradients for a step, of the parameters' shapes and dtypes."""
  key = jax.random.PRNGKey(1000 + step)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten(
      [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def train(opt, params, steps, *, jit=True, on_state=None, pin_out_shardings=True):
  """Runs ``steps`` updates with a donated, jitted train step; returns params, state and step.

  With ``pin_out_shardings`` the step's outputs are pinned to the inputs'
  shardings and memory kinds, as the README advises: without them JAX pairs
  donated buffers with outputs by shape alone, whatever their memory.
  """

  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  # Committed parameters give step 1 the argument placements that every later
  # step sees, so the step compiles once.
  params = jax.tree.map(lambda x: jax.device_put(jnp.copy(x), x.sharding), params)
  state = opt.init(params)
  if jit:
    shardings = jax.tree.map(lambda x: x.sharding, (params, state)) if pin_out_shardings else None
    step = jax.jit(step, donate_argnums=(0, 1), out_shardings=shardings)
  if on_state:
    on_state(state)
  for i in range(steps):
    params, state = step(params, state, grads_at(params, i))
    if on_state:
      on_state(state)
  return params, state, step


def float64_adamw(param, grads, learning_rates, *, b1, b2, eps, weight_decay):
  """AdamW in float64, the textbook way, one step per gradient and learning rate."""
  param, mu, nu = np.asarray(param, np.float64), 0.0, 0.0
  for count, (grad, lr) in enumerate(zip(grads, learning_rates), start=1):
    grad = np.asarray(grad, np.float64)
    mu = b1 * mu + (1 - b1) * grad
    nu = b2 * nu + (1 - b2) * grad**2
    mu_hat, nu_hat = mu / (1 - b1**count), nu / (1 - b2**count)
    param = param - lr * (mu_hat / (np.sqrt(nu_hat) + eps) + weight_decay * param)
  return param


def max_rel_diff(a, b):
  """The largest max|a - b| / max|b| over the leaves, computed in float64."""
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    worst = max(worst, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)))
  return worst


def moment_kinds(adam_state):
  """(offloaded, memory kind) for each leaf of an offloaded Adam state's mu and nu."""
  offloaded = adam_state.plan.offloaded
  return [(o, x.sharding.memory_kind)
          for moments in (adam_state.mu, adam_state.nu)
          for o, x in zip(offloaded, jax.tree.leaves(moments))]


def assert_moments_placed(adam_state):
  """Offloaded leaves' moments are in pinned_host, the others on the device."""
  for offloaded, kind in moment_kinds(adam_state):
    assert kind == ("pinned_host" if offloaded else "device")


def relayouts(hlo: str) -> list[str]:
  """The instructions of a compiled module's text (fused computations included) that put
  elements in another order: transposes, and copies whose layout is not their operand's."""
  shapes = dict(re.findall(r"%([\w.\-]+) = (\S+\[[^\]]*\](?:\{[^}]*\})?)", hlo))
  found = re.findall(r"%[\w.\-]+ = \S+ transpose\(.*", hlo)
  for line, out, source in re.findall(r"(%[\w.\-]+ = (\S+) copy\(%([\w.\-]+)\).*)", hlo):
    if shapes.get(source) != out:
      found.append(line)
  return found
