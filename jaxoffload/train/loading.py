"""A ``Config`` from a YAML file and ``section.key=value`` overrides, checked once.

Every key's name and type is checked here, and every rule of the reference
system by ``jaxoffload.train.rules``, before anything is compiled. Problems
raise ``ConfigError`` with one message that names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import typing
from typing import Any, Optional, Sequence

import yaml

from jaxoffload.hf.config import CheckpointError, read_config
from jaxoffload.nn.model import LlamaConfig
from jaxoffload.train import rules
from jaxoffload.train.checkpoints import checkpoint_meta
from jaxoffload.train.config import Config, ConfigError

# LlamaConfig fields a checkpoint does not decide: how the run computes, and on what.
RUN_FIELDS = ("dtype", "params_dtype", "seq_length", "attention_implementation", "scan_layers")

# Keys jaxoffload no longer has, and why: a config naming one is refused with the reason,
# not a guess at the nearest key.
_DELAYED_UPDATE = ("a one-step-delayed host update is not Adam's; the exact host kernel "
                   "overlaps the next step's forward pass instead "
                   "(docs/performance.md#optimizer-offload)")
REMOVED_KEYS = {
    **{f"optimizer.{key}": _DELAYED_UPDATE for key in (
        "delayed_update", "delayed_update_after", "delayed_update_predict_weights")},
    "optimizer.offload_weight_copies": (
        "the host kernel keeps no bfloat16 copies of float32 weights: with bfloat16 transfers "
        "it keeps each master as the bfloat16 weight the device reads plus its 16-bit "
        "remainder (optimizer.store_param_remainders, on by default; False: float32 weights "
        "the device rounds itself)")}


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> Config:
  """Reads ``path`` (YAML, optional), applies ``overrides`` and checks the result once.

  A file may start from another: ``base_config: llama_1b.yaml`` (a path
  relative to the file) reads that one first, then this file's keys over it.
  With ``model.hf_checkpoint`` the model's shape comes from its config.json, with
  ``checkpoint.init_from`` from that run's saved config.

  Args:
    path: a YAML file of sections (model, optimizer, train, ...); None: the defaults.
    overrides: ``section.key=value`` strings, values read as YAML, applied last.

  Returns:
    The checked ``Config``.

  Raises:
    ConfigError: naming the key, for an unknown key, a wrong type or a broken rule.

  Example:
    >>> config = load_config("configs/tiny.yaml", ["optimizer.optimizer_offload_fraction=0.5"])
  """
  items = [] if path is None else _file_items(path, ())
  items += [parse_override(text) for text in overrides]
  config = _with_values(Config(), items)
  given = {key for key, _ in items}
  if config.model.hf_checkpoint is not None:
    try:
      source = read_config(config.model.hf_checkpoint)
    except CheckpointError as error:
      raise ConfigError(str(error)) from None
    config = _with_shape_of(config, source, f"{config.model.hf_checkpoint}/config.json", given)
  elif config.checkpoint.init_from is not None:
    meta = checkpoint_meta.read_meta(*checkpoint_meta.locate(config.checkpoint.init_from))
    source = config_from_dict(meta["config"]).model.llama()
    config = _with_shape_of(config, source, f"the run in {config.checkpoint.init_from}", given)
  rules.check(config)
  return config


def override(config: Config, overrides: Sequence[str]) -> Config:
  """``config`` with ``section.key=value`` overrides applied, and checked once.

  Raises:
    ConfigError: naming the key, for an unknown key, a wrong type or a broken rule.

  Example:
    >>> smaller = override(config, ["train.micro_batch_size=2"])
  """
  changed = _with_values(config, [parse_override(text) for text in overrides])
  rules.check(changed)
  return changed


def config_from_dict(values: dict[str, dict[str, Any]]) -> Config:
  """The ``Config`` that ``dataclasses.asdict`` made ``values`` from (a checkpoint's meta),
  types checked, with no file read: it was checked when it ran. Removed keys, which an
  older checkpoint's config holds, are left out."""
  return _with_values(Config(), [(key, value) for key, value in _flatten(values)
                                 if key not in REMOVED_KEYS])


def _with_shape_of(config: Config, source: LlamaConfig, where: str, given: set[str]
                   ) -> Config:
  """``config`` with the model's shape taken from ``source``.

  Raises:
    ConfigError: for a shape key ``given`` (in a file or an override, whatever its value)
      that disagrees.
  """
  shape = [f.name for f in dataclasses.fields(LlamaConfig) if f.name not in RUN_FIELDS]
  for name in shape:
    value, read = getattr(config.model, name), getattr(source, name)
    if f"model.{name}" in given and value != read:
      raise ConfigError(f"model.{name}={value!r} disagrees with {where}, which makes it "
                        f"{read!r}; leave model.{name} out")
  return dataclasses.replace(config, model=dataclasses.replace(
      config.model, **{name: getattr(source, name) for name in shape}))


def _with_values(config: Config, items: Sequence[tuple[str, Any]]) -> Config:
  """``config`` with each dotted key set to its value, types checked (no rules).

  Raises:
    ConfigError: for an unknown key or a value of the wrong type.
  """
  values: dict[str, dict[str, Any]] = {}
  for dotted, value in items:
    section, key, kind = _field(dotted)
    values.setdefault(section, {})[key] = _coerce(dotted, value, kind)
  return dataclasses.replace(config, **{
      section: dataclasses.replace(getattr(config, section), **fields)
      for section, fields in values.items()})


def parse_override(text: str) -> tuple[str, Any]:
  """``"optimizer.lr=3e-4"`` as ``("optimizer.lr", 3e-4)``; values are read as YAML."""
  key, sep, raw = text.partition("=")
  if not sep or not key:
    raise ConfigError(f"override {text!r} must look like section.key=value")
  return key.strip(), yaml.safe_load(raw) if raw.strip() else None


@functools.cache
def _types(cls: type) -> dict[str, Any]:
  """``cls``'s fields' types, evaluated once: the planner applies overrides thousands of times."""
  return typing.get_type_hints(cls)


def _field(dotted: str) -> tuple[str, str, Any]:
  """The section, key and type a dotted key names, or a ConfigError with the nearest key
  (or why a removed key is gone)."""
  if dotted in REMOVED_KEYS:
    raise ConfigError(f"{dotted} was removed: {REMOVED_KEYS[dotted]}")
  section, _, key = dotted.partition(".")
  sections = _types(Config)
  if section not in sections or not key:
    raise ConfigError(f"unknown config key {dotted!r}" + _closest(
        section, [f"{name}." for name in sections]))
  hints = _types(sections[section])
  if key not in hints:
    raise ConfigError(f"unknown config key {dotted!r}" + _closest(
        dotted, [f"{section}.{name}" for name in hints]))
  return section, key, hints[key]


def _closest(name: str, candidates: Sequence[str]) -> str:
  match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
  return f"; did you mean {match[0]!r}?" if match else f"; valid: {', '.join(candidates)}"


def _coerce(key: str, value: Any, expected: Any) -> Any:
  """``value`` as the field's type (ints widen to floats), or a ConfigError naming the key."""
  allowed = typing.get_args(expected) if typing.get_origin(expected) is typing.Union else (expected,)
  if value is None and type(None) in allowed:
    return None
  for kind in allowed:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
      return float(value)
    if kind is float and isinstance(value, str):
      # YAML reads 3e-4 (no dot) as a string; a float field takes it as the number.
      try:
        return float(value)
      except ValueError:
        pass
    if kind is not type(None) and type(value) is kind:
      return value
  names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in allowed)
  raise ConfigError(f"{key} must be {names}, got {value!r} ({type(value).__name__})")


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
  if not isinstance(tree, dict):
    return [(prefix, tree)]
  if prefix.count(".") >= 1:
    raise ConfigError(f"config key {prefix!r} takes a value, not a mapping")
  items = []
  for key, value in tree.items():
    items += _flatten(value, f"{prefix}.{key}" if prefix else str(key))
  return items


def _file_items(path: str, including: tuple[str, ...]) -> list[tuple[str, Any]]:
  """The file's (key, value) pairs, after those of the file its ``base_config`` names."""
  try:
    with open(path) as f:
      data = yaml.safe_load(f) or {}
  except OSError as error:
    raise ConfigError(f"cannot read config file {path!r}: {error.strerror}") from None
  except yaml.YAMLError as error:
    raise ConfigError(f"config file {path!r} is not valid YAML: {error}") from None
  if not isinstance(data, dict):
    raise ConfigError(f"config file {path!r} must hold a mapping of sections")
  base = data.pop("base_config", None)
  if base is None:
    return _flatten(data)
  if not isinstance(base, str):
    raise ConfigError(f"base_config in {path!r} must be a file name, got {base!r}")
  # Relative to the including file, as a user reading it would expect.
  base_path = os.path.normpath(os.path.join(os.path.dirname(path), base))
  chain = including + (os.path.normpath(path),)
  if base_path in chain:
    raise ConfigError(f"config files include each other: {' -> '.join(chain + (base_path,))}")
  return _file_items(base_path, chain) + _flatten(data)
