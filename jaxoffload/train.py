"""Train the Llama model with any combination of offloads: ``python -m jaxoffload.train``.

  python -m jaxoffload.train [--config configs/NAME.yaml] [section.key=value ...]

With no arguments it trains the tiny default model (the defaults of
``jaxoffload.config``) on synthetic tokens, on whatever backend JAX finds, CPU
included, and prints the loss as it falls. Keys and rules: docs/config.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp

import jaxoffload
from jaxoffload import remat, sharding
from jaxoffload._compat import DEVICE_KIND, to_device, to_host
from jaxoffload.config import Config, ConfigError, load_config, validate
from jaxoffload.model import (Llama, LlamaConfig, group_name, init_params, logical_param_specs,
                              next_token_loss, regroup)


def llama_config(config: Config) -> LlamaConfig:
  """The model's sizes and dtypes from the ``model.*`` section."""
  m = config.model
  return LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                     intermediate_size=m.intermediate_size, num_layers=m.num_layers,
                     num_heads=m.num_attention_heads, num_kv_heads=m.num_query_groups,
                     max_seq_len=m.seq_length, dtype=jnp.dtype(m.dtype),
                     param_dtype=jnp.dtype(m.params_dtype),
                     tie_embeddings=m.share_embeddings_and_output_weights,
                     attention_implementation=m.attention_implementation)


def optimizer(config: Config) -> optax.GradientTransformation:
  """Clipped AdamW on the configured schedule; offloaded when ``optimizer_cpu_offload``."""
  o, iters = config.optimizer, config.train.train_iters
  warmup = min(o.lr_warmup_iters, iters)
  decay = {"constant": optax.constant_schedule(o.lr),
           "linear": optax.linear_schedule(o.lr, o.min_lr, max(iters - warmup, 1)),
           "cosine": optax.cosine_decay_schedule(o.lr, max(iters - warmup, 1), o.min_lr / o.lr)}
  schedule = optax.join_schedules([optax.linear_schedule(0.0, o.lr, warmup),
                                   decay[o.lr_decay_style]], [warmup])
  adamw_args = dict(b1=o.adam_beta1, b2=o.adam_beta2, eps=o.adam_eps, weight_decay=o.weight_decay)
  if o.optimizer_cpu_offload:
    adamw = jaxoffload.offload_adamw(schedule, **adamw_args,
                                     offload_fraction=o.optimizer_offload_fraction,
                                     update_on=o.optimizer_offload_update_on)
  else:
    adamw = optax.adamw(schedule, **adamw_args)
  return optax.chain(optax.clip_by_global_norm(o.clip_grad), adamw)


def synthetic_batches(config: Config, step: int) -> jax.Array:
  """Step ``step``'s tokens: each sequence counts up by a stride from a random start.

  The next token follows from the current one and the sequence's stride, so a
  model that learns shows a falling loss within a few dozen steps.
  """
  m, t = config.model, config.train
  key = jax.random.fold_in(jax.random.PRNGKey(t.seed), step)
  start_key, stride_key = jax.random.split(key)
  shape = (t.global_batch_size, 1)
  start = jax.random.randint(start_key, shape, 0, m.vocab_size)
  stride = jax.random.randint(stride_key, shape, 1, 4)
  return (start + stride * jnp.arange(m.seq_length)[None, :]) % m.vocab_size


def build(config: Config):
  """Placed parameters, optimizer state, the jitted train step and the batch sharding."""
  groups = validate(config)
  model_config = llama_config(config)
  mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  model = Llama(model_config, groups)
  tokens = synthetic_batches(config, 0)
  # One stack first, then cut at the groups: every offload setting starts from the
  # same weights, so their losses can be compared step by step.
  one_stack = Llama(model_config, remat.layer_groups(model_config.num_layers))
  params = regroup(init_params(one_stack, jax.random.PRNGKey(config.train.seed), tokens), groups)
  shardings = sharding.logical_shardings(mesh, logical_param_specs(model, tokens))
  host_groups = [group_name(group) for group in groups if group.offload_weights]
  for name in host_groups:
    shardings[name] = sharding.in_pinned_host(shardings[name])
  params = jax.device_put(params, shardings)
  opt = optimizer(config)
  # Initialised from the parameters' shapes and device shardings: host-resident
  # weights must not be read, and their optimizer state starts where the plan says.
  on_device = lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype,
                                             sharding=p.sharding.with_memory_kind(DEVICE_KIND))
  state = opt.init(jax.tree.map(on_device, params))
  micro_batches = config.train.global_batch_size // config.train.micro_batch_size

  def loss_fn(params, tokens):
    return next_token_loss(model.apply({"params": params}, tokens), tokens)

  def train_step(params, state, tokens):
    # Gradients of weights kept in host memory arrive there; they join the rest
    # on the device for accumulation, clipping and the update.
    grad_fn = lambda p, t: jax.tree.map(to_device, jax.value_and_grad(loss_fn)(p, t))
    if micro_batches == 1:
      loss, grads = grad_fn(params, tokens)
    else:
      split = tokens.reshape(micro_batches, -1, tokens.shape[-1])

      def accumulate(total, micro):
        loss, grads = grad_fn(params, micro)
        return jax.tree.map(jnp.add, total, (loss, grads)), None

      zeros = (jnp.zeros(()), jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params))
      (loss, grads), _ = jax.lax.scan(accumulate, zeros, split)
      loss, grads = jax.tree.map(lambda x: x / micro_batches, (loss, grads))
    device_params = jax.tree.map(to_device, params)
    updates, state = opt.update(grads, state, device_params)
    new_params = optax.apply_updates(device_params, updates)
    for name in host_groups:
      new_params[name] = to_host(new_params[name])
    return new_params, state, loss

  # Scalars optax made uncommitted are replicated over the mesh, so that step 1
  # sees the placements every later step sees and the step compiles once.
  state_shardings = jax.tree.map(
      lambda x: x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding)
      else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), state)
  state = jax.device_put(state, state_shardings)
  step = jax.jit(train_step, donate_argnums=(0, 1),
                 out_shardings=(shardings, state_shardings, None))
  return params, state, step, sharding.batch_sharding(mesh)


def _checkpoints(config: Config) -> ocp.CheckpointManager | None:
  c = config.checkpoint
  if c.dir is None:
    return None
  options = ocp.CheckpointManagerOptions(max_to_keep=c.keep, enable_async_checkpointing=True)
  return ocp.CheckpointManager(os.path.abspath(c.dir), options=options)


def train(config: Config, *, log=print, stop_after_step: int | None = None) -> list[float]:
  """Runs steps up to ``config.train.train_iters``; returns the loss of each step run.

  ``stop_after_step`` ends the run early, as an interruption would, after
  saving a checkpoint there: the schedule still spans ``train_iters``.

  With ``checkpoint.dir`` set it saves every ``checkpoint.save_interval`` steps
  and at the last, and with ``checkpoint.resume`` continues from the newest
  checkpoint there: the offloaded optimizer state is restored straight into
  host memory, since the restore target names each leaf's memory kind.
  """
  params, state, step, batch_sharding = build(config)
  m, t = config.model, config.train
  checkpoints = _checkpoints(config)
  first = 0
  if checkpoints is not None and config.checkpoint.resume and checkpoints.latest_step() is not None:
    first = checkpoints.latest_step()
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          {"params": params, "opt_state": state})
    restored = checkpoints.restore(first, args=ocp.args.StandardRestore(target))
    params, state = restored["params"], restored["opt_state"]
    log(f"resumed from step {first} in {config.checkpoint.dir}")
  tokens_per_step = t.global_batch_size * m.seq_length
  log(f"backend {jax.default_backend()}; {m.num_layers} layers, hidden {m.hidden_size}; "
      f"{t.global_batch_size} x {m.seq_length} tokens a step")
  if config.optimizer.optimizer_cpu_offload:
    log(str(jaxoffload.find_offload_plan(state)))
  losses = []
  every = max(1, t.train_iters // 10)
  last = t.train_iters if stop_after_step is None else min(stop_after_step, t.train_iters)
  for i in range(first, last):
    tokens = jax.device_put(synthetic_batches(config, i), batch_sharding)
    start = time.perf_counter()
    params, state, loss = step(params, state, tokens)
    losses.append(float(loss))
    seconds = time.perf_counter() - start
    if not math.isfinite(losses[-1]):
      if checkpoints is not None:
        checkpoints.wait_until_finished()
      raise FloatingPointError(f"loss is {losses[-1]} at step {i + 1}; stopping" + (
          f" (the newest good checkpoint is step {checkpoints.latest_step()})"
          if checkpoints is not None and checkpoints.latest_step() is not None else ""))
    if checkpoints is not None and ((i + 1) % config.checkpoint.save_interval == 0
                                    or i + 1 == last):
      checkpoints.save(i + 1, args=ocp.args.StandardSave({"params": params, "opt_state": state}))
    if i == first or (i + 1) % every == 0 or i + 1 == last:
      peak = jaxoffload.peak_device_bytes()
      log(f"step {i + 1:5d}  loss {losses[-1]:.4f}  {seconds * 1e3:8.1f} ms  "
          f"{tokens_per_step / seconds:10.0f} tokens/s"
          + (f"  peak device {peak / 2**30:.2f} GiB" if peak else ""))
  if checkpoints is not None:
    checkpoints.wait_until_finished()
  return losses


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m jaxoffload.train", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config",
                      help="a YAML file of sections (model, optimizer, train, mesh, checkpoint)")
  parser.add_argument("overrides", nargs="*", metavar="section.key=value")
  args = parser.parse_args(argv)
  try:
    config = load_config(args.config, args.overrides)
  except ConfigError as error:
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2) from None
  start = time.perf_counter()
  try:
    losses = train(config)
  except FloatingPointError as error:
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(1) from None
  if losses:
    print(f"{len(losses)} steps in {time.perf_counter() - start:.1f} s; "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
  main()
