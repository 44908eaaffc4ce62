"""Orbax checkpoints of a ``Trainer``: asynchronous saves, restored straight into its placements.

A checkpoint holds four items: ``params`` (the whole parameter tree, whatever
was offloaded), ``opt_state``, ``host`` (the host kernel's moments, if any) and
``meta`` (the resolved config and the step, as JSON). Orbax records no memory
kind, so a restore reads into a target that names each leaf's sharding and
memory kind: offloaded state goes straight back to host memory. ``params``
alone can be read into any placement: to fine-tune from another run
(``checkpoint.init_from``) or to export (``python -m jaxoffload.export``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional

import orbax.checkpoint as ocp

from jaxoffload.model import LlamaConfig
from jaxoffload.train import rules
from jaxoffload.train.config import Config, ConfigError, ModelConfig
from jaxoffload.train.loading import config_from_dict
from jaxoffload.train.step import Trainer


def manager(config: Config) -> Optional[ocp.CheckpointManager]:
  """Orbax's manager of ``checkpoint.dir`` (the newest ``keep`` kept); None without a dir.

  Raises:
    ConfigError: naming the directory, when it is a file or cannot be written.
  """
  c = config.checkpoint
  if c.dir is None:
    return None
  path = os.path.abspath(c.dir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f"checkpoint.dir {path!r} is a file, not a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as error:
    raise ConfigError(f"checkpoint.dir {path!r} cannot be created: {error.strerror}") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise ConfigError(f"checkpoint.dir {path!r} is not writable")
  options = ocp.CheckpointManagerOptions(max_to_keep=c.keep, enable_async_checkpointing=True)
  return ocp.CheckpointManager(path, options=options)


def save(checkpoints: ocp.CheckpointManager, step: int, trainer: Trainer) -> None:
  """Starts an asynchronous save of the trainer's state, its config and the step."""
  items = {name: ocp.args.StandardSave(tree) for name, tree in trainer.checkpoint().items()}
  meta = {"step": step, "config": dataclasses.asdict(trainer.setup.config)}
  checkpoints.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items))


def restore(checkpoints: ocp.CheckpointManager, step: int, trainer: Trainer) -> None:
  """Loads step ``step`` into ``trainer``, each leaf in the trainer's placement."""
  items = {name: ocp.args.StandardRestore(target)
           for name, target in trainer.checkpoint_target().items()}
  restored = checkpoints.restore(step, args=ocp.args.Composite(**items))
  trainer.load({name: restored[name] for name in items})


def restore_newest(checkpoints: ocp.CheckpointManager, trainer: Trainer,
                   log: Callable[[str], None]) -> Optional[int]:
  """Loads the newest readable step into ``trainer``; returns it, or None when there is none.

  Steps newer than it that cannot be read (a damaged file) are renamed
  ``STEP.unreadable``, never deleted, each with a warning: the run continues
  from the readable step and its own saves do not collide with them.

  Raises:
    ConfigError: when there are steps and none of them can be read (nothing is renamed).
  """
  directory = os.fspath(checkpoints.directory)
  unreadable = []
  for step in sorted(checkpoints.all_steps(), reverse=True):
    try:
      theirs = config_from_dict(read_meta(checkpoints, step)["config"])
    except Exception as error:  # A damaged step: orbax's JSON, or a config no longer valid.
      unreadable.append((step, _reason(error)))
      continue
    model, settings = resume_differences(theirs, trainer.setup.config)
    if model:
      raise ConfigError(f"checkpoint step {step} in {directory} holds another model "
                        f"({'; '.join(model)}): give this run a new checkpoint.dir")
    if settings:
      raise ConfigError(
          f"checkpoint step {step} in {directory} cannot be resumed under this run's settings "
          f"({'; '.join(settings)}): the offload fraction and the device or host update may "
          f"change between runs, these may not; set them as the checkpoint has, or take its "
          f"weights alone with checkpoint.init_from={directory}")
    try:
      restore(checkpoints, step, trainer)
    except Exception as error:  # Whatever orbax or tensorstore raise for a damaged step.
      unreadable.append((step, _reason(error)))
      continue
    for bad, reason in unreadable:
      aside = os.path.join(directory, f"{bad}.unreadable")
      os.rename(os.path.join(directory, str(bad)), aside)
      log(f"warning: checkpoint step {bad} cannot be read ({reason}); kept as {aside}")
    checkpoints.reload()
    return step
  if unreadable:
    step, reason = unreadable[-1]
    raise ConfigError(f"no checkpoint in {directory} can be read; the oldest, step {step}: "
                      f"{reason}")
  return None


def resume_differences(theirs: Config, ours: Config) -> tuple[list[str], list[str]]:
  """What keeps a checkpoint written under ``theirs`` from resuming under ``ours``, each as
  ``"key: theirs -> ours"``: the model's differences, then the settings' (its layer groups,
  which optimizer holds the state)."""
  changed = lambda section, keys: [
      f"{section}.{key}: {getattr(getattr(theirs, section), key)!r} -> "
      f"{getattr(getattr(ours, section), key)!r}" for key in keys
      if getattr(getattr(theirs, section), key) != getattr(getattr(ours, section), key)]
  model = changed("model", [f.name for f in dataclasses.fields(LlamaConfig)
                            if f.name not in ("dtype", "seq_length", "attention_implementation")])
  settings = []
  if rules.layer_groups(theirs) != rules.layer_groups(ours):
    settings += changed("model", [f.name for f in dataclasses.fields(ModelConfig)
                                  if f.name.startswith(("cpu_offloading", "recompute",
                                                        "fine_grained"))])
  if _optimizer_kind(theirs) != _optimizer_kind(ours):
    settings += changed("optimizer", ("optimizer_cpu_offload", "optimizer_offload_update_on",
                                      "delayed_update", "exp_avg_dtype", "exp_avg_sq_dtype"))
  return model, settings


def _optimizer_kind(config: Config) -> tuple:
  """Which optimizer's state a run checkpoints, in which dtypes: optax's AdamW, the offloaded
  one, or the host kernel's (with a held gradient when delayed)."""
  o, dtypes = config.optimizer, rules.moment_dtypes(config)
  if not o.optimizer_cpu_offload:
    return ("offload_adamw", dtypes) if rules.compact_moments(config) else ("adamw",)
  if o.optimizer_offload_update_on == "host_kernel":
    return ("host_kernel", o.delayed_update)
  return ("offload_adamw", dtypes)


def _reason(error: Exception) -> str:
  text = str(error).strip()
  return type(error).__name__ + (f": {text.splitlines()[0][:200]}" if text else "")


def locate(path: str) -> tuple[ocp.CheckpointManager, int]:
  """The manager and step of ``path``: a checkpoint directory (its newest step) or a step in one.

  Raises:
    ConfigError: naming the path, when it holds no checkpoint.
  """
  path = os.path.abspath(path)
  parent, name = os.path.split(path)
  if name.isdigit() and os.path.isdir(path):
    return ocp.CheckpointManager(parent), int(name)
  if not os.path.isdir(path):
    raise ConfigError(f"checkpoint {path!r} is not a directory")
  checkpoints = ocp.CheckpointManager(path)
  step = checkpoints.latest_step()
  if step is None:
    raise ConfigError(f"{path!r} holds no checkpoint")
  return checkpoints, step


def read_meta(checkpoints: ocp.CheckpointManager, step: int) -> dict[str, Any]:
  """The ``meta`` item of a step: ``{"step": ..., "config": {...}}``."""
  return checkpoints.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def restore_params(checkpoints: ocp.CheckpointManager, step: int, target: Any) -> Any:
  """Step ``step``'s parameter tree alone, read into ``target``'s shapes and placements."""
  restored = checkpoints.restore(
      step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
  return restored["params"]
