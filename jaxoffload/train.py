"""Train the Llama model with any combination of offloads: ``python -m jaxoffload.train``.

  python -m jaxoffload.train [--config configs/NAME.yaml] [section.key=value ...]

With no arguments it trains the tiny default model (the defaults of
``jaxoffload.config``) on synthetic tokens, on whatever backend JAX finds, CPU
included, and prints the loss as it falls.

examples:
  python -m jaxoffload.train data.dataset=text train.train_iters=200
  python -m jaxoffload.train --config configs/llama_1b_optimizer_offload.yaml
  python -m jaxoffload.train --config configs/llama_1b.yaml \\
      optimizer.optimizer_cpu_offload=True optimizer.optimizer_offload_fraction=0.5 \\
      model.cpu_offloading=True model.cpu_offloading_num_layers=11 logging.jsonl=steps.jsonl

Every key, its default and the reference's rules: docs/config.md. Configs for
each offload mode: configs/. Measured costs: docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jaxoffload
from jaxoffload import data, monitor, remat, sharding
from jaxoffload._compat import DEVICE_KIND, to_device, to_host
from jaxoffload.config import Config, ConfigError, load_config, validate
from jaxoffload.model import (Llama, LlamaConfig, group_name, init_params, logical_param_specs,
                              next_token_loss)


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


def batch_at(config: Config, step: int) -> jax.Array:
  """Step ``step``'s tokens, [global_batch_size, seq_length]: synthetic or text (``data.*``)."""
  m, t = config.model, config.train
  if config.data.dataset == "text":
    tokens = data.corpus_tokens(config.data.text_file, m.seq_length)
    return data.text_batch(tokens, t.seed, step, t.global_batch_size, m.seq_length)
  return data.synthetic_batch(t.seed, step, t.global_batch_size, m.seq_length, m.vocab_size)


def global_batch(config: Config, step: int, batch_sharding: jax.sharding.Sharding) -> jax.Array:
  """Step ``step``'s tokens as one array over the mesh; each process places only its own shards.

  Every process computes the same global batch from the seed and the step, so
  no process needs another's data.
  """
  tokens = np.asarray(batch_at(config, step))
  return jax.make_array_from_callback(tokens.shape, batch_sharding, lambda index: tokens[index])


def build(config: Config):
  """Placed parameters, optimizer state, the jitted train step and the batch sharding."""
  groups = validate(config)
  model_config = llama_config(config)
  mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  if jax.process_count() > 1 and mesh.size != jax.device_count():
    raise ConfigError(f"mesh data={config.mesh.data} x fsdp={config.mesh.fsdp} x tensor="
                      f"{config.mesh.tensor} must use all {jax.device_count()} devices of the "
                      f"{jax.process_count()} processes")
  model = Llama(model_config, groups)
  tokens = batch_at(config, 0)
  shardings = sharding.logical_shardings(mesh, logical_param_specs(model, tokens))
  host_groups = [group_name(group) for group in groups if group.offload_weights]
  for name in host_groups:
    shardings[name] = sharding.in_pinned_host(shardings[name])
  # Initialised as one stack and cut at the groups: every offload setting starts
  # from the same weights, so their losses can be compared step by step.
  one_stack = Llama(model_config, remat.layer_groups(model_config.num_layers))
  params = init_params(one_stack, jax.random.PRNGKey(config.train.seed), tokens, shardings,
                       groups=groups)
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


def restore(checkpoints: ocp.CheckpointManager, step: int, params, state):
  """Step ``step``'s parameters and optimizer state, read straight into the shardings and
  memory kinds of ``params`` and ``state`` (orbax records no memory kind, so the target names it).
  """
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        {"params": params, "opt_state": state})
  restored = checkpoints.restore(step, args=ocp.args.StandardRestore(target))
  return restored["params"], restored["opt_state"]


def checkpoint_manager(config: Config) -> ocp.CheckpointManager | None:
  """Orbax's manager of ``checkpoint.dir``: asynchronous saves, the newest ``keep`` kept."""
  c = config.checkpoint
  if c.dir is None:
    return None
  options = ocp.CheckpointManagerOptions(max_to_keep=c.keep, enable_async_checkpointing=True)
  return ocp.CheckpointManager(os.path.abspath(c.dir), options=options)


@dataclasses.dataclass
class Run:
  """What a training run did: each step's record and the compiled step's memory estimate."""

  records: list[monitor.StepRecord]
  compile_s: float
  # XLA's estimate for the compiled step: device bytes of arguments, outputs
  # and temporaries (aliased donations counted once), and host temporaries.
  compiled_device_bytes: int
  compiled_host_temp_bytes: int
  offloaded_state_bytes: int  # Parameters and optimizer state in pinned_host.

  @property
  def losses(self) -> list[float]:
    return [r.loss for r in self.records]


def train(config: Config, *, log=print, stop_after_step: int | None = None) -> list[float]:
  """Runs steps up to ``config.train.train_iters``; returns the loss of each step run.

  ``run`` takes the same arguments and returns the whole ``Run``.
  """
  return run(config, log=log, stop_after_step=stop_after_step).losses


def run(config: Config, *, log=print, stop_after_step: int | None = None) -> Run:
  """Runs steps up to ``config.train.train_iters``; returns each step's record.

  Across several processes (``distributed.*``) every process runs this; only
  process 0 logs and writes the JSONL file.

  ``stop_after_step`` ends the run early, as an interruption would, after
  saving a checkpoint there: the schedule still spans ``train_iters``.

  With ``checkpoint.dir`` set it saves every ``checkpoint.save_interval`` steps
  and at the last, and with ``checkpoint.resume`` continues from the newest
  checkpoint there: the offloaded optimizer state is restored straight into
  host memory, since the restore target names each leaf's memory kind.
  Progress goes to ``log`` (a line redrawn in place when it is ``print`` on a
  terminal) and, with ``logging.jsonl`` set, one JSON record per step.
  """
  reporting = jax.process_index() == 0
  if not reporting:
    log = lambda _: None
  if (config.model.cuda_graph_impl != "none"
      and COMMAND_BUFFER_FLAG not in os.environ.get("XLA_FLAGS", "")):
    log(f"warning: model.cuda_graph_impl={config.model.cuda_graph_impl!r} needs XLA_FLAGS="
        f"{COMMAND_BUFFER_FLAG} before JAX starts; python -m jaxoffload.train sets it")
  params, state, step, batch_sharding = build(config)
  m, t = config.model, config.train
  checkpoints = checkpoint_manager(config)
  first = 0
  if checkpoints is not None and config.checkpoint.resume and checkpoints.latest_step() is not None:
    first = checkpoints.latest_step()
    params, state = restore(checkpoints, first, params, state)
    log(f"resumed from step {first} in {config.checkpoint.dir}")
  log(f"backend {jax.default_backend()} ({jax.device_count()} x {jax.devices()[0].device_kind}); "
      f"{m.num_layers} layers, hidden {m.hidden_size}; "
      f"{t.global_batch_size} x {m.seq_length} tokens a step of {config.data.dataset} data")
  if config.optimizer.optimizer_cpu_offload:
    log(str(jaxoffload.find_offload_plan(state)))
  compile_start = time.perf_counter()
  compiled = step.lower(params, state, global_batch(config, first, batch_sharding)).compile()
  compile_s = time.perf_counter() - compile_start
  analysis = compiled.memory_analysis()
  host_temp = getattr(analysis, "host_temp_size_in_bytes", 0) or 0
  offloaded_state = jaxoffload.bytes_by_memory_kind((params, state)).get("pinned_host", 0)
  log(f"compiled the step in {compile_s:.1f} s")
  last = t.train_iters if stop_after_step is None else min(stop_after_step, t.train_iters)
  jsonl = open(config.logging.jsonl, "a") if config.logging.jsonl and reporting else None
  meter = monitor.Monitor(
      total_steps=t.train_iters, tokens_per_step=t.global_batch_size * m.seq_length,
      flops_per_token=monitor.flops_per_token(llama_config(config), m.seq_length),
      peak_flops=(monitor.peak_flops(jax.devices()[0], m.dtype) or 0) * jax.device_count(),
      pinned_host_bytes=offloaded_state + host_temp,
      log=log, log_interval=config.logging.log_interval, jsonl=jsonl,
      live=config.logging.progress_bar and log is print and sys.stdout.isatty(),
      peak_device_bytes=jaxoffload.peak_device_bytes)
  try:
    for i in range(first, last):
      tokens = global_batch(config, i, batch_sharding)
      start = time.perf_counter()
      params, state, loss = compiled(params, state, tokens)
      loss = float(loss.addressable_data(0))  # Replicated: every process holds it.
      meter.record(step=i + 1, loss=loss, step_s=time.perf_counter() - start)
      if not math.isfinite(loss):
        if checkpoints is not None:
          checkpoints.wait_until_finished()
        raise FloatingPointError(f"loss is {loss} at step {i + 1}; stopping" + (
            f" (the newest good checkpoint is step {checkpoints.latest_step()})"
            if checkpoints is not None and checkpoints.latest_step() is not None else ""))
      if checkpoints is not None and ((i + 1) % config.checkpoint.save_interval == 0
                                      or i + 1 == last):
        checkpoints.save(i + 1, args=ocp.args.StandardSave({"params": params, "opt_state": state}))
  finally:
    if jsonl is not None:
      jsonl.close()
  if checkpoints is not None:
    checkpoints.wait_until_finished()
  log(meter.summary())
  device_bytes = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                  - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)
  return Run(meter.records, compile_s, device_bytes, host_temp, offloaded_state)


# Megatron's CUDA graphs, in XLA's terms: command buffers that capture loops and
# conditionals too, not only XLA's default kernels and library calls.
COMMAND_BUFFER_FLAG = ("--xla_gpu_enable_command_buffer="
                       "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL")


def set_xla_flags(config: Config) -> None:
  """Adds the XLA flags the config asks for; they act only if JAX has not started its backends."""
  if config.model.cuda_graph_impl != "none":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFER_FLAG}".strip()


def start_processes(config: Config) -> None:
  """Joins this process to the others with ``jax.distributed.initialize`` when the config asks.

  Must run before JAX starts its backends. On CPUs the processes exchange data
  through gloo.
  """
  d = config.distributed
  if not d.initialize:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=d.coordinator_address,
                             num_processes=d.num_processes, process_id=d.process_id)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m jaxoffload.train", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config",
                      help="a YAML file of sections (model, optimizer, train, data, logging, "
                           "mesh, distributed, checkpoint)")
  parser.add_argument("overrides", nargs="*", metavar="section.key=value")
  args = parser.parse_args(argv)
  try:
    config = load_config(args.config, args.overrides)
  except ConfigError as error:
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2) from None
  set_xla_flags(config)
  start_processes(config)
  try:
    train(config)
  except FloatingPointError as error:
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(1) from None
  except jax.errors.JaxRuntimeError as error:
    if "RESOURCE_EXHAUSTED" not in str(error):
      raise
    print(f"error: out of device memory: {str(error).splitlines()[0]}\n"
          "Offload more: optimizer.optimizer_cpu_offload=True with a larger "
          "optimizer.optimizer_offload_fraction, or model.cpu_offloading=True with more "
          "model.cpu_offloading_num_layers (docs/config.md).", file=sys.stderr)
    raise SystemExit(1) from None


if __name__ == "__main__":
  main()
