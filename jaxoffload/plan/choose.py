"""What the trainer's entry point asks the planner for: ``choose`` settles a config's
``train.fit=auto`` and ``optimizer.optimizer_offload_fraction=auto`` on this machine."""

from __future__ import annotations

import jax

from jaxoffload.plan import fit
from jaxoffload.plan.fit import Log
from jaxoffload.plan.search import plan
from jaxoffload.train import advice, host_memory
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.loading import override


def choose(config: Config) -> tuple[Config, tuple[str, ...]]:
  """Settles what the trainer leaves to the planner: ``config`` with ``train.fit=auto``'s
  settings chosen by the planner's search (``fastest_fit``), then an
  ``auto`` offload fraction replaced by ``fit.fastest_offload``'s pick, and a line for each
  choice.

  Raises:
    ConfigError: where nothing fits, or ``train.fit=auto`` runs in several processes.

  Example:
    config, chosen = choose(load_config(path, overrides))
    train(config, choices=chosen)
  """
  chosen = []
  if "auto" not in (config.train.fit, config.optimizer.optimizer_offload_fraction):
    return config, ()
  advice.check_backend(config, jax.default_backend())  # Before it compiles anything.
  if config.train.fit == "auto":
    config = fastest_fit(config, log=chosen.append)
  if config.optimizer.optimizer_offload_fraction == "auto":
    config = fit.fastest_offload(config, log=chosen.append)
  return config, tuple(chosen)


def fastest_fit(config: Config, log: Log = print) -> Config:
  """``config`` with the fastest setting the planner's search (``search.plan``) finds that
  fits this machine's budgets (``fit.budgets_of``), said in one line to ``log``.

  Raises:
    ConfigError: where nothing fits, or in several processes (each would search apart).
  """
  if jax.process_count() > 1:
    raise ConfigError("train.fit=auto searches in one process: run python -m jaxoffload.plan "
                      "on one host and set what it prints")
  best, _ = plan(config, fit.budgets_of(config), log=lambda _: None)
  if best is None:
    raise ConfigError("train.fit=auto: no setting fits this machine (python -m jaxoffload.plan "
                      "shows each); lower train.global_batch_size or model.seq_length, or use "
                      "more devices (mesh.fsdp)")
  peak = "-" if best.device_bytes is None else host_memory.size(best.device_bytes)
  log(f"train.fit=auto chose {best.activations}, micro-batch {best.micro_batch_size}, offload "
      f"{best.fraction:.2f} on {best.update_on}, {best.moments} moments (device peak {peak}, "
      f"host {host_memory.size(best.host_bytes)}; predicted {best.step_s * 1e3:,.1f} ms a "
      f"step): {' '.join(best.overrides)}")
  return override(config, list(best.overrides))
