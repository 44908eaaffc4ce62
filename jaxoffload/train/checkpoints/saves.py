"""Orbax checkpoints of a ``Trainer``: asynchronous saves, resumed under any offload setting.

A checkpoint holds the run's state in a form no setting owns: ``params`` (the
whole parameter tree, whatever was offloaded), ``mu`` and ``nu`` (Adam's
moments, trees like it, whichever optimizer held them) and ``meta`` (the
resolved config and the step, as JSON); the host kernel's leaves of those trees, in
one process, as float32 ``.npy`` files of a ``host`` item written a piece at a time
from the live state (``host_checkpoint``). Orbax records no memory kind: a resume
reads each leaf into the resuming run's grouping, dtype and placement
(``jaxoffload.train.checkpoints.reader``), so a run can change its offload fraction, its
update placement, its activation or weights offload and its moments' dtypes
between two runs. ``params`` alone starts another run
(``checkpoint.init_from``) or an export (``python -m jaxoffload.train.export``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import re
import shutil
from typing import Any, Callable, Iterator, Optional

import orbax.checkpoint as ocp

from jaxoffload.nn.model import LlamaConfig
from jaxoffload.train import implied
from jaxoffload.train.checkpoints import checkpoint_dir, host_checkpoint, reader
from jaxoffload.train.checkpoints.checkpoint_meta import read_meta
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.loading import RUN_FIELDS, config_from_dict
from jaxoffload.train.schedule import learning_rate
from jaxoffload.train.setup import Setup
from jaxoffload.train.step import STATE_ITEMS, Moments, Trainer


def manager(config: Config) -> Optional[ocp.CheckpointManager]:
  """Orbax's manager of ``checkpoint.dir`` (the newest ``keep`` kept), which removes what
  saves that never ended left (``checkpoint_dir.claim`` it first); None without a dir.

  Raises:
    ConfigError: naming the directory, when it is a file or cannot be written.
  """
  c = config.checkpoint
  if c.dir is None:
    return None
  _quiet_orbax_errors()
  options = ocp.CheckpointManagerOptions(max_to_keep=c.keep, enable_async_checkpointing=True,
                                         cleanup_tmp_directories=True)
  return ocp.CheckpointManager(checkpoint_dir.made(c.dir), options=options)


class _OrbaxErrors(logging.Filter):
  """Leaves out the errors orbax logs as a save fails, from its threads and from its asyncio
  tasks: the same failure comes back from the save, as the run's one line (``_writing``)."""

  def filter(self, record: logging.LogRecord) -> bool:
    orbax = f"{os.sep}orbax{os.sep}"
    return not (record.levelno >= logging.ERROR
                and (orbax in record.pathname or orbax in record.getMessage()))


def _quiet_orbax_errors() -> None:
  """Installs ``_OrbaxErrors`` on the loggers orbax's errors reach (absl's, asyncio's), once."""
  for name in ("absl", "asyncio"):
    logger = logging.getLogger(name)
    if not any(isinstance(f, _OrbaxErrors) for f in logger.filters):
      logger.addFilter(_OrbaxErrors())


def save(checkpoints: ocp.CheckpointManager, step: int, trainer: Trainer) -> None:
  """Saves the trainer's state, its config and the step: asynchronously, unless the state
  has buffers in host memory, which orbax reads where they are and so must have written
  before the next step updates or donates them. A save the disk has no room for is not
  started.

  Raises:
    ConfigError: naming the directory and why, when this save or the one before failed or
      the disk has no room for this one.
  """
  with _writing(checkpoints):
    checkpoints.wait_until_finished()  # As orbax's save would: the space left is then known.
  checkpoint_dir.check_space(os.fspath(checkpoints.directory), trainer.setup, step,
                             checkpoints.all_steps())
  state = trainer.checkpoint_items()  # Applies what the host still holds.
  host = state.pop(host_checkpoint.ITEM, None)
  meta = {"step": step, "config": dataclasses.asdict(trainer.setup.config)}
  if trainer.host is not None:  # Whether the next update may start before its clipping.
    meta["host_last_grad_scale"] = trainer.host.last_grad_scale
  items = {name: ocp.args.PyTreeSave(tree) for name, tree in state.items()}
  if host is not None:
    items[host_checkpoint.ITEM] = host_checkpoint.HostLeavesSave(host)
  with _writing(checkpoints):
    checkpoints.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items))
    if trainer.setup.state_in_host_memory:
      checkpoints.wait_until_finished()


def close(checkpoints: ocp.CheckpointManager) -> None:
  """Waits for a save in flight and stops orbax's threads.

  Raises:
    ConfigError: naming the directory and why, when that save failed.
  """
  with _writing(checkpoints):
    checkpoints.close()


# Why a write failed, as the operating system says it, wherever orbax's message has it.
_OS_REASONS = re.compile(r"No space left on device|Disk quota exceeded|Read-only file system|"
                         r"Permission denied")


@contextlib.contextmanager
def _writing(checkpoints: ocp.CheckpointManager) -> Iterator[None]:
  """Turns a failed save into one line naming the directory, the reason and the intact
  steps (orbax leaves the failed one in a temporary directory, which resumes skip)."""
  try:
    yield
  except Exception as error:  # Whatever orbax or tensorstore raise for a failed write.
    found = _OS_REASONS.search(str(error))
    reason = found.group(0) if found else _reason(error)
    with contextlib.suppress(Exception):  # An earlier save still in flight is complete first.
      checkpoints.wait_until_finished()
    directory = os.fspath(checkpoints.directory)
    # What the failed save wrote, incomplete; the run's claim keeps other writers out.
    for partial in glob.glob(f"{glob.escape(directory)}/*{ocp.utils.TMP_DIR_SUFFIX}*"):
      shutil.rmtree(partial, ignore_errors=True)
    checkpoints.reload()
    steps = sorted(checkpoints.all_steps())
    raise ConfigError(f"a checkpoint could not be written to {directory!r} "
                      f"({reason}); the run stopped; its complete checkpoints: steps "
                      f"{steps or 'none'}") from None


def read(checkpoints: ocp.CheckpointManager, step: int, setup: Setup) -> tuple[Any, Moments]:
  """Step ``step``'s parameters and moments, read into ``setup``'s grouping, dtypes and
  placements (``Trainer(setup, *read(...))`` continues from them)."""
  meta = read_meta(checkpoints, step)
  saved_groups = layer_ranges(config_from_dict(meta["config"]))
  targets = Trainer.from_shapes(setup).restore_targets()
  params, mu, nu = (reader.read_tree(checkpoints, step, name, saved_groups, targets[name])
                    for name in STATE_ITEMS)
  return params, Moments(meta["step"], mu, nu)


def layer_ranges(config: Config) -> list[range]:
  """The layers of each of ``config``'s layer groups: how its checkpoints cut the stacks."""
  return [range(g.start, g.stop) for g in implied.layer_groups(config)]


def restore_newest(checkpoints: ocp.CheckpointManager, setup: Setup,
                   log: Callable[[str], None]) -> Optional[tuple[int, Trainer]]:
  """A trainer continuing from the newest readable step, and that step; None when there is
  none.

  Steps newer than it that cannot be read (a damaged file) are renamed
  ``STEP.unreadable``, never deleted, each with a warning: the run continues
  from the readable step and its own saves do not collide with them.

  Raises:
    ConfigError: when a step holds another model or a state this setting cannot take,
      or when there are steps and none of them can be read (nothing is renamed).
  """
  directory = os.fspath(checkpoints.directory)
  unreadable = []
  for step in sorted(checkpoints.all_steps(), reverse=True):
    try:
      meta = read_meta(checkpoints, step)
      theirs = config_from_dict(meta["config"])
    except Exception as error:  # A damaged step: orbax's JSON, or a config no longer valid.
      unreadable.append((step, _reason(error)))
      continue
    model = model_differences(theirs, setup.config)
    if model:
      raise ConfigError(f"checkpoint step {step} in {directory} holds another model "
                        f"({'; '.join(model)}): give this run a new checkpoint.dir")
    why = _not_resumable(meta, os.path.join(directory, str(step)))
    if why:
      raise ConfigError(f"checkpoint step {step} in {directory} cannot be resumed ({why}): "
                        f"take its weights alone with checkpoint.init_from={directory}")
    iters = setup.config.train.train_iters
    if meta["step"] > iters:
      raise ConfigError(f"checkpoint step {meta['step']} in {directory} is past "
                        f"train.train_iters={iters}: raise train.train_iters, or give this run "
                        f"a new checkpoint.dir")
    try:
      trainer = Trainer(setup, *read(checkpoints, step, setup))
    except Exception as error:  # Whatever orbax or tensorstore raise for a damaged step.
      unreadable.append((step, _reason(error)))
      continue
    if trainer.host is not None:
      trainer.host.last_grad_scale = meta.get("host_last_grad_scale")
    note = schedule_change(theirs, setup, meta["step"])
    if note:
      log(note)
    for bad, reason in unreadable:
      aside = os.path.join(directory, f"{bad}.unreadable")
      os.rename(os.path.join(directory, str(bad)), aside)
      log(f"warning: checkpoint step {bad} cannot be read ({reason}); kept as {aside}")
    checkpoints.reload()
    return step, trainer
  if unreadable:
    step, reason = unreadable[-1]
    raise ConfigError(f"no checkpoint in {directory} can be read; the oldest, step {step}: "
                      f"{reason}")
  return None


def schedule_change(theirs: Config, setup: Setup, step: int) -> Optional[str]:
  """A note where the resumed run's learning rate for the next step is not the saved run's
  (the schedule's warm-up and decay follow train.train_iters and the optimizer's lr keys);
  None where they agree."""
  keys = [("train.train_iters", theirs.train.train_iters, setup.config.train.train_iters)] + [
      (f"optimizer.{k}", getattr(theirs.optimizer, k), getattr(setup.config.optimizer, k))
      for k in ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style")]
  changed = [f"{key} {a} -> {b}" for key, a, b in keys if a != b]
  saved, now = float(learning_rate(theirs)(step)), float(setup.schedule(step))
  if not changed or saved == now:
    return None
  return (f"note: the learning-rate schedule changed at resume ({', '.join(changed)}): step "
          f"{step + 1} runs at {now:.3g}, where the saved run's schedule gives {saved:.3g}")


def model_differences(theirs: Config, ours: Config) -> list[str]:
  """What keeps a checkpoint written under ``theirs`` from resuming under ``ours``: the
  model's differences, each as ``"model.key: theirs -> ours"``."""
  # How the run computes may change; the parameters' dtype is the checkpoint's.
  keys = [f.name for f in dataclasses.fields(LlamaConfig)
          if f.name not in RUN_FIELDS or f.name == "params_dtype"]
  return [f"model.{key}: {getattr(theirs.model, key)!r} -> {getattr(ours.model, key)!r}"
          for key in keys if getattr(theirs.model, key) != getattr(ours.model, key)]


def _not_resumable(meta: dict[str, Any], step_dir: str) -> Optional[str]:
  """Why a step of this model written by an earlier jaxoffload cannot be resumed, or None."""
  if meta.get("host_kernel"):  # Its keys: the removed delayed update's held gradients.
    return ("it holds the held gradients of a delayed host update "
            "(optimizer.delayed_update), which jaxoffload no longer applies")
  if not os.path.isdir(os.path.join(step_dir, "mu")):
    return "written by an earlier jaxoffload, with no placement-free moments"
  return None


def _reason(error: Exception) -> str:
  text = str(error).strip()
  return type(error).__name__ + (f": {text.splitlines()[0][:200]}" if text else "")
