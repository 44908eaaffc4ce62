"""The trainer, a user of the library: ``python -m jaxoffload.train``.

``load_config`` reads and checks a config, ``resolve`` turns it into what a
run needs, ``Trainer`` holds the placed state and the jitted step, and
``run`` / ``train`` drive it, with checkpoints and per-step records.
"""

from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.loading import load_config
from jaxoffload.train.loop import Run, run, train
from jaxoffload.train.resolve import resolve
from jaxoffload.train.setup import Setup
from jaxoffload.train.step import Trainer

__all__ = ["Config", "ConfigError", "Run", "Setup", "Trainer", "load_config", "resolve", "run",
           "train"]
