"""A run's learning rate at each update, from its ``optimizer`` keys: ``learning_rate``.

Example:
  >>> learning_rate(load_config(None, ["optimizer.lr=1e-3"]))(0)  # 0.0: the warm-up's start.
"""

from __future__ import annotations

import optax

from jaxoffload.train.config import Config


def learning_rate(config: Config) -> optax.Schedule:
  """Linear warm-up to ``optimizer.lr``, then the configured decay to ``min_lr``.

  Args:
    config: the run's config (its ``optimizer`` and ``train.train_iters``).

  Returns:
    The optax schedule of the whole run.
  """
  o, iters = config.optimizer, config.train.train_iters
  warmup = min(o.lr_warmup_iters, iters)
  decay = {"constant": optax.constant_schedule(o.lr),
           "linear": optax.linear_schedule(o.lr, o.min_lr, max(iters - warmup, 1)),
           "cosine": optax.cosine_decay_schedule(o.lr, max(iters - warmup, 1), o.min_lr / o.lr)}
  return optax.join_schedules([optax.linear_schedule(0.0, o.lr, warmup),
                               decay[o.lr_decay_style]], [warmup])
