"""What the trainer and the planner set up before JAX compiles: where compiled programs are
kept between runs (the pinned pool's sizing: test_host_memory)."""

import os
import subprocess
import sys

import jax

from jaxoffload.train import launch, load_config


def test_compiled_programs_are_kept_where_the_config_says(tmp_path):
  # In a fresh process, without the cache settings the tests give JAX (conftest).
  code = """
import os, jax
from jaxoffload.train import launch, load_config
assert launch.keep_compiled(load_config(None, ["train.compilation_cache_dir=null"])) is None
assert not jax.config.jax_compilation_cache_dir
directory = launch.keep_compiled(load_config(None, ["train.compilation_cache_dir=~/xla"]))
jax.jit(lambda x: x * 2)(1.0).block_until_ready()  # Compiled in far less than a second.
print(directory, jax.config.jax_compilation_cache_dir,
      sum(name.endswith("-cache") for name in os.listdir(directory)))
"""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
  env["HOME"] = str(tmp_path)
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  directory, configured, programs = done.stdout.split()
  assert directory == configured == str(tmp_path / "xla")
  assert int(programs) >= 1


def test_a_compilation_cache_jax_was_given_stands():
  given = jax.config.jax_compilation_cache_dir
  assert given == os.environ["JAX_COMPILATION_CACHE_DIR"]  # conftest's.
  assert launch.keep_compiled(load_config(None, [])) is None
  assert jax.config.jax_compilation_cache_dir == given
