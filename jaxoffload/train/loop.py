"""The training loop: ``run(config)`` resolves, builds, restores, trains, checkpoints and reports."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Callable, Optional, Sequence, TextIO

import jax

import jaxoffload
from jaxoffload.memory import host_rss_bytes
from jaxoffload.train import advice, device_memory, host_memory, launch, metrics, stopping, weights
from jaxoffload.train.checkpoints import checkpoint_dir, saves as ckpt
from jaxoffload.train.config import Config
from jaxoffload.train.resolve import resolve
from jaxoffload.train.setup import Setup
from jaxoffload.train.step import Trainer

Log = Callable[[str], None]


@dataclasses.dataclass
class Run:
  """What a training run did: each step's record and what the compiled step holds.

  Attributes:
    setup: what the run was resolved to.
    records: one per step run.
    compile_s: seconds to compile the step.
    compiled_device_bytes: XLA's estimate for the compiled step: device bytes of
      arguments, outputs and temporaries (aliased donations counted once).
    compiled_host_temp_bytes: the compiled step's host temporaries.
    offloaded_state_bytes: parameters and optimizer state held in host memory.
  """

  setup: Setup
  records: list[metrics.StepRecord]
  compile_s: float
  compiled_device_bytes: int
  compiled_host_temp_bytes: int
  offloaded_state_bytes: int

  @property
  def losses(self) -> list[float]:
    return [r.loss for r in self.records]


def train(config: Config, *, log: Log = print, stop_after_step: Optional[int] = None,
          choices: Sequence[str] = ()) -> list[float]:
  """Runs steps up to ``config.train.train_iters``; returns the loss of each step run."""
  return run(config, log=log, stop_after_step=stop_after_step, choices=choices).losses


def run(config: Config, *, log: Log = print, stop_after_step: Optional[int] = None,
        choices: Sequence[str] = ()) -> Run:
  """Runs steps up to ``config.train.train_iters``; returns each step's record.

  Across several processes (``distributed.*``) every process runs this; only
  process 0 logs and writes the JSONL file. With ``checkpoint.dir`` it saves
  every ``checkpoint.save_interval`` steps and at the last, and with
  ``checkpoint.resume`` continues from the newest checkpoint there.

  Args:
    config: a checked config (``load_config``) with no ``auto`` offload fraction (the
      planner's ``jaxoffload.plan.choose`` settles one).
    log: where progress lines go; on a terminal, ``print`` redraws one line in place.
    stop_after_step: end early, as an interruption would, after saving a
      checkpoint there; the schedule still spans ``train_iters``.
    choices: what the planner chose for ``config``, a line each, announced first.

  Returns:
    The ``Run``: each step's record and the compiled step's memory.
  """
  reporting = jax.process_index() == 0
  if not reporting:
    log = lambda _: None
  advice.check_backend(config, jax.default_backend())
  setup = resolve(config, choices=choices)
  config = setup.config
  # Before anything is allocated or compiled.
  need = host_memory.check(setup)
  device_memory.check(setup)
  if launch.sized_pinned_pool_gib is not None and host_memory.pinned_pool_limit() is not None:
    log(f"host memory: XLA's pinned pool of each GPU sized to {launch.sized_pinned_pool_gib} "
        f"GiB for the {host_memory.size(host_memory.pinned_per_device(setup))} it holds at "
        f"once ({host_memory.PINNED_POOL_VARIABLE})")
  else:
    pool_note = host_memory.pool_limit_advice(need)
    if pool_note:
      log(f"note: host memory: {pool_note}")
  claim = checkpoint_dir.claim(config)
  if claim is not None and claim.taken_over:
    log(f"note: checkpoint.dir was claimed by {claim.taken_over}, which ended without letting "
        f"go; this run takes it over")
  checkpoints = jsonl = None
  try:
    # Made first: a missing writer or a file that cannot be written is found before anything
    # compiles.
    tensorboard = (metrics.TensorBoard(config.logging.tensorboard_dir)
                   if config.logging.tensorboard_dir and reporting else None)
    jsonl = (metrics.open_jsonl(config.logging.jsonl) if config.logging.jsonl and reporting
             else None)
    if config.logging.profile_dir:
      metrics.make_folder("logging.profile_dir", config.logging.profile_dir)
    checkpoints = ckpt.manager(config)
    if checkpoints is not None:
      checkpoint_dir.check_space(os.fspath(checkpoints.directory), setup)
    return _run(setup, checkpoints, jsonl, tensorboard, log, stop_after_step)
  except jax.errors.JaxRuntimeError as error:
    # What the auto settings chose: the out-of-memory advice names levers from there.
    error.resolved_config = config
    raise
  finally:
    if jsonl is not None:
      jsonl.close()
    try:
      if checkpoints is not None:
        ckpt.close(checkpoints)
    finally:
      if claim is not None:
        claim.release()


def _run(setup: Setup, checkpoints, jsonl: Optional[TextIO],
         tensorboard: Optional[metrics.TensorBoard], log: Log, stop_after_step: Optional[int]
         ) -> Run:
  """``run`` once the setup is resolved and the checkpoint directory, the JSONL file and the
  TensorBoard writer open (each None where not asked for)."""
  config = setup.config
  resumed = (ckpt.restore_newest(checkpoints, setup, log)
             if checkpoints is not None and config.checkpoint.resume else None)
  if resumed is None:
    first, trainer = 0, Trainer(setup, weights.initial(setup))
  else:
    first, trainer = resumed
    log(f"resumed from step {first} in {config.checkpoint.dir}")
  _announce(setup, trainer, log)
  compile_start = time.perf_counter()
  compiled = trainer.compile(setup.global_batch(first))
  compile_s = time.perf_counter() - compile_start
  log(f"compiled the step in {compile_s:.1f} s")
  peak = compiled.device_bytes
  if config.eval.interval > 0:  # Its program is known before the first step too.
    peak = max(peak, trainer.compile_evaluation(setup.eval_batch(0)))
  device_memory.check_compiled(setup, peak)
  host_temp = compiled.host_temp_bytes
  pinned, offloaded_state = _host_bytes(trainer)
  last = (config.train.train_iters if stop_after_step is None
          else min(stop_after_step, config.train.train_iters))
  meter = _monitor(setup, pinned + host_temp, log, jsonl, tensorboard)
  try:
    _train(setup, trainer, checkpoints, meter, range(first, last), log)
  finally:
    meter.close()
  if trainer.host is not None:
    trainer.host.finish()
    if trainer.host.speculated:
      log(f"host kernel: {trainer.host.speculated} updates started during the backward pass "
          f"before their clipping, {trainer.host.undone} of them taken back and applied again "
          f"clipped")
  log(meter.summary())
  return Run(setup, meter.records, compile_s, compiled.device_bytes, host_temp, offloaded_state)


def _train(setup: Setup, trainer: Trainer, checkpoints, meter: metrics.Monitor, steps: range,
           log: Log) -> None:
  """The steps themselves: update, record, evaluate, checkpoint, stop on a bad loss or when
  a signal asks (``stopping``)."""
  config = setup.config
  profiler = metrics.Profiler(config.logging.profile_dir, config.logging.profile_start_step,
                              config.logging.profile_steps, log)
  with stopping.StopRequests(checkpoints) as stop:
    for i in steps:
      tokens = setup.global_batch(i)
      profiler.before(i + 1)
      start = time.perf_counter()
      loss, grad_norm = trainer.step(tokens)
      loss = float(loss.addressable_data(0))  # Replicated: every process has it.
      step_s = time.perf_counter() - start
      profiler.after(i + 1, trainer.params)
      due = config.eval.interval and ((i + 1) % config.eval.interval == 0 or i + 1 == steps.stop)
      meter.record(step=i + 1, loss=loss, step_s=step_s,
                   learning_rate=float(setup.schedule(i)),
                   grad_norm=float(grad_norm.addressable_data(0)),
                   eval_loss=_evaluate(setup, trainer) if due else None)
      if not math.isfinite(loss):
        _stop_on_bad_loss(loss, i + 1, checkpoints)
      signum = stop.asked(i + 1)
      if checkpoints is not None and ((i + 1) % config.checkpoint.save_interval == 0
                                      or i + 1 == steps.stop or signum is not None):
        ckpt.save(checkpoints, i + 1, trainer)
      if signum is not None:
        raise stopping.stopped(signum, i + 1, config)


def _evaluate(setup: Setup, trainer: Trainer) -> float:
  """The mean held-out loss over ``eval.iters`` batches."""
  losses = [trainer.evaluate(setup.eval_batch(i)) for i in range(setup.config.eval.iters)]
  return sum(float(x.addressable_data(0)) for x in losses) / len(losses)


def _monitor(setup: Setup, pinned_host_bytes: int, log: Log, jsonl: Optional[TextIO],
             tensorboard: Optional[metrics.TensorBoard]) -> metrics.Monitor:
  """Where each step's figures go: the progress line, JSONL, TensorBoard."""
  config, m, t = setup.config, setup.config.model, setup.config.train
  return metrics.Monitor(
      total_steps=t.train_iters, tokens_per_step=t.global_batch_size * m.seq_length,
      flops_per_token=metrics.flops_per_token(setup.model, m.seq_length),
      peak_flops=(metrics.peak_flops(jax.devices()[0], m.dtype) or 0) * jax.device_count(),
      pinned_host_bytes=pinned_host_bytes, log=log, log_interval=config.logging.log_interval,
      jsonl=jsonl, tensorboard=tensorboard,
      live=config.logging.progress_bar and log is print and sys.stdout.isatty(),
      progress_bar=config.logging.progress_bar,
      peak_device_bytes=jaxoffload.peak_device_bytes, host_rss_bytes=host_rss_bytes)


def _announce(setup: Setup, trainer: Trainer, log: Log) -> None:
  """The run's first lines: the backend and shapes, where offloaded state lives, warnings."""
  config, m, t = setup.config, setup.config.model, setup.config.train
  log(f"backend {jax.default_backend()} ({jax.device_count()} x {jax.devices()[0].device_kind}); "
      f"{m.num_layers} layers, hidden {m.hidden_size}; "
      f"{t.global_batch_size} x {m.seq_length} tokens a step of {config.data.dataset} data")
  for line in setup.choices:
    log(line)
  if trainer.host is not None:
    log(str(trainer.host))
  elif setup.offload is not None:
    log(str(setup.offload))
  backend = jax.default_backend()
  warnings = advice.warnings(config, backend) + advice.unrolled_recompute(
      config, backend, setup.runs_per_layer)
  # Elsewhere the flag changes nothing: advice.warnings says so.
  if backend == "gpu" and m.cuda_graph_impl != "none" and (
      launch.COMMAND_BUFFER_FLAG not in os.environ.get("XLA_FLAGS", "")):
    warnings.append(f"warning: model.cuda_graph_impl={m.cuda_graph_impl!r} needs XLA_FLAGS="
                    f"{launch.COMMAND_BUFFER_FLAG} before JAX starts; python -m jaxoffload.train "
                    f"sets it")
  for warning in warnings:
    log(warning)


def _host_bytes(trainer: Trainer) -> tuple[int, int]:
  """Pinned host bytes the trainer holds, and of those the training state the device would."""
  pinned = jaxoffload.bytes_by_memory_kind((trainer.params, trainer.opt_state)).get(
      "pinned_host", 0)
  if trainer.host is None:
    return pinned, pinned
  # Its moments are host memory too, though not pinned; its second buffers and
  # bfloat16 copies are pinned, but no state the device would hold.
  host = trainer.host
  return pinned + host.pinned_bytes, pinned + host.weight_bytes + host.moment_bytes


def _stop_on_bad_loss(loss: float, step: int, checkpoints) -> None:
  if checkpoints is not None:
    checkpoints.wait_until_finished()
  newest = None if checkpoints is None else checkpoints.latest_step()
  raise FloatingPointError(f"loss is {loss} at step {step}; stopping" + (
      f" (the newest good checkpoint is step {newest})" if newest is not None else ""))
