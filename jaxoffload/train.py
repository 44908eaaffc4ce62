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
import importlib.util
import math
import os
import sys
import time
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

import jaxoffload
from jaxoffload import autoplace, data, monitor, remat, sharding
from jaxoffload._compat import DEVICE_KIND, to_device, to_host
from jaxoffload.config import Config, ConfigError, load_config, validate
from jaxoffload.host_offload import HostAdamW
from jaxoffload.model import (Llama, LlamaConfig, abstract_params, compute_dtypes, group_name,
                              init_params, logical_param_specs, next_token_loss)
from jaxoffload.placement import leaf_path, plan_offload


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


def learning_rate(config: Config) -> optax.Schedule:
  """Linear warm-up to ``optimizer.lr``, then the configured decay to ``min_lr``."""
  o, iters = config.optimizer, config.train.train_iters
  warmup = min(o.lr_warmup_iters, iters)
  decay = {"constant": optax.constant_schedule(o.lr),
           "linear": optax.linear_schedule(o.lr, o.min_lr, max(iters - warmup, 1)),
           "cosine": optax.cosine_decay_schedule(o.lr, max(iters - warmup, 1), o.min_lr / o.lr)}
  return optax.join_schedules([optax.linear_schedule(0.0, o.lr, warmup),
                               decay[o.lr_decay_style]], [warmup])


def adamw_args(config: Config) -> dict:
  o = config.optimizer
  return dict(b1=o.adam_beta1, b2=o.adam_beta2, eps=o.adam_eps, weight_decay=o.weight_decay)


def optimizer(config: Config) -> optax.GradientTransformation:
  """Clipped AdamW on the configured schedule; offloaded when ``optimizer_cpu_offload``."""
  o = config.optimizer
  if o.optimizer_cpu_offload:
    adamw = jaxoffload.offload_adamw(learning_rate(config), **adamw_args(config),
                                     offload_fraction=o.optimizer_offload_fraction,
                                     update_on=o.optimizer_offload_update_on,
                                     overlap_transfers=o.overlap_cpu_optimizer_d2h_h2d)
  else:
    adamw = optax.adamw(learning_rate(config), **adamw_args(config))
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


class Built(NamedTuple):
  """What ``build`` makes. With the host kernel (``optimizer_offload_update_on=host_kernel``)
  ``params`` are the device-resident leaves, in tree order, and ``host`` holds the others."""

  params: Any
  state: Any
  step: Any  # The jitted train step.
  batch_sharding: jax.sharding.Sharding
  host: Optional[HostAdamW] = None


def resolve_update_place(config: Config) -> tuple[Config, Optional[autoplace.Choice]]:
  """``config`` with ``optimizer_offload_update_on=auto`` replaced by the exact placement this
  machine runs fastest, and that choice (``str`` shows it); any other config unchanged."""
  o = config.optimizer
  if o.optimizer_offload_update_on != "auto":
    return config, None
  resolved = lambda place: dataclasses.replace(
      config, optimizer=dataclasses.replace(o, optimizer_offload_update_on=place))
  if not o.optimizer_cpu_offload:
    return resolved("device"), None
  shapes = abstract_params(Llama(llama_config(config), validate(config)), batch_at(config, 0))
  mask = plan_offload(shapes, offload_fraction=o.optimizer_offload_fraction).mask
  offloaded = sum(x.size for x, off in zip(jax.tree.leaves(shapes), jax.tree.leaves(mask)) if off)
  # Each device copies its own shards; the host kernel updates all of this process's.
  per_device = offloaded // (config.mesh.fsdp * config.mesh.tensor)
  choice = autoplace.choose(
      autoplace.measure_machine(), offloaded_elements=per_device, moment_bytes_per_element=8,
      transfer_bytes_per_element=jnp.dtype(o.offload_transfer_dtype).itemsize,
      local_elements=per_device * jax.local_device_count(),
      host_kernel=(config.model.params_dtype == "float32"
                   and importlib.util.find_spec("numba") is not None))
  if jax.process_count() > 1:
    # Every process must build the same program: process 0's choice holds.
    places = list(choice.predicted_s)
    first = multihost_utils.broadcast_one_to_all(np.int32(places.index(choice.place)))
    choice = dataclasses.replace(choice, place=places[int(first)])
  return resolved(choice.place), choice


def build(config: Config) -> Built:
  """Placed parameters, optimizer state, the jitted train step and the batch sharding.

  The step is ``step(params, state, tokens) -> (params, state, loss)``; with the
  host kernel it is ``step(params, host.params, state, tokens) -> (params,
  state, loss, host_grads, clip_scale)`` and ``host.update(host_grads,
  clip_scale)`` follows it.
  """
  if config.optimizer.optimizer_offload_update_on == "auto":
    raise ValueError("build needs a placement: resolve optimizer_offload_update_on=auto with "
                     "resolve_update_place first (run does)")
  groups = validate(config)
  mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  model_config = dataclasses.replace(llama_config(config), mesh=mesh)
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
  o = config.optimizer
  host_kernel = o.optimizer_cpu_offload and o.optimizer_offload_update_on == "host_kernel"
  if host_kernel:
    # ZeRO-Offload's split: the chosen leaves' weights live in pinned_host too.
    offloaded = plan_offload(abstract_params(model, tokens),
                             offload_fraction=o.optimizer_offload_fraction).mask
    shardings = jax.tree.map(lambda s, off: sharding.in_pinned_host(s) if off else s,
                             shardings, offloaded)
  # Initialised as one stack and cut at the groups: every offload setting starts
  # from the same weights, so their losses can be compared step by step.
  one_stack = Llama(model_config, remat.layer_groups(model_config.num_layers))
  params = init_params(one_stack, jax.random.PRNGKey(config.train.seed), tokens, shardings,
                       groups=groups)
  micro_batches = config.train.global_batch_size // config.train.micro_batch_size

  def loss_fn(params, tokens):
    return next_token_loss(model.apply({"params": params}, tokens), tokens)

  def loss_and_grads(params, tokens):
    # Gradients of weights kept in host memory arrive there; they join the rest
    # on the device for accumulation, clipping and the update.
    grad_fn = lambda p, t: jax.tree.map(to_device, jax.value_and_grad(loss_fn)(p, t))
    if micro_batches == 1:
      return grad_fn(params, tokens)
    split = tokens.reshape(micro_batches, -1, tokens.shape[-1])

    def accumulate(total, micro):
      return jax.tree.map(jnp.add, total, grad_fn(params, micro)), None

    # Summed in float32 whatever the leaves' dtype (bfloat16 host weights, say).
    zeros = (jnp.zeros(()), jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    (loss, grads), _ = jax.lax.scan(accumulate, zeros, split)
    return jax.tree.map(lambda x: x / micro_batches, (loss, grads))

  def init_state(opt, params):
    """``opt``'s state and its shardings, placed as every step will see them."""
    # Initialised from the parameters' shapes and device shardings: host-resident
    # weights must not be read, and their optimizer state starts where the plan says.
    state = opt.init(jax.tree.map(lambda p: jax.ShapeDtypeStruct(
        p.shape, p.dtype, sharding=p.sharding.with_memory_kind(DEVICE_KIND)), params))
    # Scalars optax made uncommitted are replicated over the mesh, so that step 1
    # sees the placements every later step sees and the step compiles once.
    state_shardings = jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding)
        else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), state)
    return jax.device_put(state, state_shardings), state_shardings

  batch_sharding = sharding.batch_sharding(mesh)
  if host_kernel:
    return _host_kernel_build(config, params, shardings, offloaded, host_groups, loss_and_grads,
                              init_state, batch_sharding)
  opt = optimizer(config)
  state, state_shardings = init_state(opt, params)

  def train_step(params, state, tokens):
    loss, grads = loss_and_grads(params, tokens)
    device_params = jax.tree.map(to_device, params)
    updates, state = opt.update(grads, state, device_params)
    new_params = optax.apply_updates(device_params, updates)
    for name in host_groups:
      new_params[name] = to_host(new_params[name])
    return new_params, state, loss

  step = jax.jit(train_step, donate_argnums=(0, 1),
                 out_shardings=(shardings, state_shardings, None))
  return Built(params, state, step, batch_sharding)


def _host_kernel_build(config, params, shardings, offloaded, host_groups, loss_and_grads,
                       init_state, batch_sharding) -> Built:
  """``build`` for ``optimizer_offload_update_on=host_kernel``: the device updates the device
  leaves in the step; ``HostAdamW`` updates the offloaded ones between steps."""
  o = config.optimizer
  leaves, treedef = jax.tree.flatten(params)
  is_host = jax.tree.leaves(offloaded)
  in_host_group = jax.tree.leaves(jax.tree_util.tree_map_with_path(
      lambda path, _: leaf_path(path).split("/")[0] in host_groups, params))
  split = lambda xs, host: [x for x, h in zip(xs, is_host) if h == host]
  leaf_shardings = jax.tree.leaves(shardings)
  device_leaves, device_shardings = split(leaves, False), split(leaf_shardings, False)
  # Leaves the model multiplies in bfloat16 may travel so (offload_transfer_dtype).
  multiplied_in = split(jax.tree.leaves(compute_dtypes(params, llama_config(config))), True)
  device_dtypes = [jnp.dtype(o.offload_transfer_dtype if d == jnp.bfloat16 else jnp.float32)
                   for d in multiplied_in]
  host = HostAdamW(split(leaves, True), learning_rate=learning_rate(config),
                   delayed=o.delayed_update, delay_after=o.delayed_update_after,
                   predict_weights=o.delayed_update_predict_weights,
                   device_dtypes=device_dtypes, **adamw_args(config))
  opt = optax.adamw(learning_rate(config), **adamw_args(config))
  state, state_shardings = init_state(opt, device_leaves)

  def train_step(device_leaves, host_leaves, state, tokens):
    # Host weights of weight-offloaded layer groups come to the device layer by
    # layer inside the model; the others come at the start of the step.
    hosts = iter([p if g else to_device(p) for p, g in zip(host_leaves, split(in_host_group, True))])
    devices = iter(device_leaves)
    tree = treedef.unflatten([next(hosts) if h else next(devices) for h in is_host])
    loss, grads = loss_and_grads(tree, tokens)
    grads = jax.tree.leaves(grads)
    # optax.clip_by_global_norm over every leaf, wherever it updates, in float32.
    norm = optax.tree.norm([g.astype(jnp.float32) for g in grads])
    clip = norm >= o.clip_grad
    device_grads = [jnp.where(clip, (g / norm.astype(g.dtype)) * o.clip_grad, g)
                    for g in split(grads, False)]
    params = [to_device(p) for p in device_leaves]
    updates, state = opt.update(device_grads, state, params)
    new_leaves = optax.apply_updates(params, updates)
    new_leaves = [to_host(p) if g else p
                  for p, g in zip(new_leaves, split(in_host_group, False))]
    # In host memory, so that the host reads it without a transfer that could
    # queue behind the next device step.
    clip_scale = to_host(jnp.where(clip, o.clip_grad / norm, 1.0))
    host_grads = [to_host(g.astype(d)) for g, d in zip(split(grads, True), device_dtypes)]
    return new_leaves, state, loss, host_grads, clip_scale

  host_grad_shardings = [s.with_memory_kind("pinned_host") for s in split(leaf_shardings, True)]
  host_scalar = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec(),
                                           memory_kind="pinned_host")
  step = jax.jit(train_step, donate_argnums=(0, 2),
                 out_shardings=(device_shardings, state_shardings, None, host_grad_shardings,
                                host_scalar))
  return Built(device_leaves, state, step, batch_sharding, host)


def save(checkpoints: ocp.CheckpointManager, step: int, params, state,
         host: Optional[HostAdamW] = None) -> None:
  """Starts an asynchronous save of the parameters and optimizer state (and the host kernel's)."""
  tree = {"params": params, "opt_state": state}
  if host is not None:
    tree["host"] = host.checkpoint()
  checkpoints.save(step, args=ocp.args.StandardSave(tree))


def restore(checkpoints: ocp.CheckpointManager, step: int, params, state,
            host: Optional[HostAdamW] = None):
  """Step ``step``'s parameters and optimizer state, read straight into the shardings and
  memory kinds of ``params`` and ``state`` (orbax records no memory kind, so the target names it).
  The host kernel's state, if any, is loaded into ``host``.
  """
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        {"params": params, "opt_state": state})
  if host is not None:
    target["host"] = host.checkpoint_target()
  restored = checkpoints.restore(step, args=ocp.args.StandardRestore(target))
  if host is not None:
    host.load(restored["host"])
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
  offloaded_state_bytes: int  # Parameters and optimizer state in host memory.

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
  config, choice = resolve_update_place(config)
  params, state, step, batch_sharding, host = build(config)
  m, t = config.model, config.train
  checkpoints = checkpoint_manager(config)
  first = 0
  if checkpoints is not None and config.checkpoint.resume and checkpoints.latest_step() is not None:
    first = checkpoints.latest_step()
    params, state = restore(checkpoints, first, params, state, host)
    log(f"resumed from step {first} in {config.checkpoint.dir}")
  log(f"backend {jax.default_backend()} ({jax.device_count()} x {jax.devices()[0].device_kind}); "
      f"{m.num_layers} layers, hidden {m.hidden_size}; "
      f"{t.global_batch_size} x {m.seq_length} tokens a step of {config.data.dataset} data")
  if choice is not None:
    log(str(choice))
  if host is not None:
    log(str(host))
  elif config.optimizer.optimizer_cpu_offload:
    log(str(jaxoffload.find_offload_plan(state)))
  for warning in offload_warnings(config, jax.default_backend()):
    log(warning)
  # The host kernel's step also reads the host-resident weights.
  host_args = () if host is None else (host.params,)
  compile_start = time.perf_counter()
  compiled = step.lower(params, *host_args, state,
                        global_batch(config, first, batch_sharding)).compile()
  compile_s = time.perf_counter() - compile_start
  analysis = compiled.memory_analysis()
  host_temp = getattr(analysis, "host_temp_size_in_bytes", 0) or 0
  pinned = jaxoffload.bytes_by_memory_kind((params, state)).get("pinned_host", 0)
  offloaded_state = pinned
  if host is not None:
    # Its moments are host memory too, though not pinned; its second buffers
    # and bfloat16 copies are pinned, but no state the device would hold.
    pinned += host.pinned_bytes
    offloaded_state += host.weight_bytes + host.moment_bytes
  log(f"compiled the step in {compile_s:.1f} s")
  last = t.train_iters if stop_after_step is None else min(stop_after_step, t.train_iters)
  jsonl = open(config.logging.jsonl, "a") if config.logging.jsonl and reporting else None
  meter = monitor.Monitor(
      total_steps=t.train_iters, tokens_per_step=t.global_batch_size * m.seq_length,
      flops_per_token=monitor.flops_per_token(llama_config(config), m.seq_length),
      peak_flops=(monitor.peak_flops(jax.devices()[0], m.dtype) or 0) * jax.device_count(),
      pinned_host_bytes=pinned + host_temp,
      log=log, log_interval=config.logging.log_interval, jsonl=jsonl,
      live=config.logging.progress_bar and log is print and sys.stdout.isatty(),
      peak_device_bytes=jaxoffload.peak_device_bytes)
  try:
    for i in range(first, last):
      tokens = global_batch(config, i, batch_sharding)
      start = time.perf_counter()
      if host is None:
        params, state, loss = compiled(params, state, tokens)
      else:
        params, state, loss, host_grads, clip_scale = compiled(params, host.params, state, tokens)
        host.update(host_grads, clip_scale)
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
        save(checkpoints, i + 1, params, state, host)
  finally:
    if jsonl is not None:
      jsonl.close()
  if host is not None:
    host.finish()
  if checkpoints is not None:
    checkpoints.wait_until_finished()
  log(meter.summary())
  device_bytes = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                  - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)
  return Run(meter.records, compile_s, device_bytes, host_temp, offloaded_state)


def offload_warnings(config: Config, backend: str) -> list[str]:
  """Warnings for the settings measured to train worse, and for those measured slow on GPUs
  (docs/benchmarks)."""
  o, mesh = config.optimizer, config.mesh
  warnings = []
  if o.delayed_update:
    warnings.append(
        f"warning: optimizer.delayed_update=True takes each gradient one update late after "
        f"the first {o.delayed_update_after} updates (optimizer.delayed_update_after): on a "
        f"1.1B Llama trained on text, with 40 exact updates first, its loss ended 0.85 nats "
        f"above the undelayed run's after 300 steps, 0.46 with "
        f"optimizer.delayed_update_predict_weights=True (now "
        f"{o.delayed_update_predict_weights}; docs/benchmarks/h200_report.md). "
        f"Compare its loss with exact updates.")
  if backend != "gpu" or not o.optimizer_cpu_offload or o.optimizer_offload_update_on != "device":
    return warnings
  if max(mesh.fsdp, mesh.tensor) > 1:
    warnings.append(
        f"warning: optimizer offload streamed through the device on a mesh with fsdp="
        f"{mesh.fsdp}, tensor={mesh.tensor} is slow on GPUs for now: XLA moves the sharded "
        f"host state through host computation (2.9x with fsdp=2 on 2 H200s, against 1.7x with "
        f"data=2; docs/benchmarks/multi_gpu_h200x2.md). mesh.data avoids it.")
  return warnings


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
