"""A trainer checkpoint as a Hugging Face Llama checkpoint: ``python -m jaxoffload.train.export``.

  python -m jaxoffload.train.export CHECKPOINT OUT [--dtype bfloat16|float16|float32]

CHECKPOINT is a run's ``checkpoint.dir`` (its newest step is taken) or one
step directory in it. OUT receives ``config.json`` and safetensors, which
transformers' ``from_pretrained`` and ``model.hf_checkpoint`` read, and the
tokenizer files of the checkpoint the run started from (``model.hf_checkpoint``)
or of its ``data.tokenizer``, where they still are. The tensors keep that
checkpoint's dtype (bfloat16 without one) and ``config.json`` its fields the
model does not decide (token ids...). The parameters are read onto the CPU,
whatever placement the run used.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Optional

from safetensors import SafetensorError

from jaxoffload.hf.checkpoint import save_checkpoint, umask
from jaxoffload.hf.config import CheckpointError, stored_dtype
from jaxoffload.train.config import ConfigError
from jaxoffload.train.weights import run_params

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def export(checkpoint: str, out: str, dtype: Optional[str] = None) -> list[str]:
  """Writes the run checkpointed in ``checkpoint`` to ``out``; returns the files written.

  Args:
    checkpoint: a trainer's checkpoint directory, or one step in it.
    out: the Hugging Face checkpoint directory to write.
    dtype: the tensors' dtype on disk; default: the stored dtype of the checkpoint the
      run started from, else bfloat16.

  Raises:
    ConfigError: naming the checkpoint, when it cannot be read; naming ``out``, when it is a
      file or a directory that holds anything, or cannot be written (nothing is left of it
      then).
  """
  out = os.path.abspath(out)
  if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
    raise ConfigError(f"{out!r} exists{' and is not empty' if os.path.isdir(out) else ''}: "
                      f"give the export a new directory")
  config, params = run_params(checkpoint)
  source = config.model.hf_checkpoint
  present = source if source and os.path.isdir(source) else None
  if dtype is None and (present is None or stored_dtype(present) is None):
    # No source's dtype to keep: the one published Llama checkpoints are shared in.
    dtype = "bfloat16"
  # Written beside it and renamed once whole: a failed export leaves nothing at ``out``.
  try:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    partial = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".partial",
                               dir=os.path.dirname(out))
  except OSError as error:
    raise ConfigError(f"{out!r} cannot be written: {error.strerror}") from None
  try:
    save_checkpoint(partial, config.model.llama(), params, dtype=dtype, source=present)
    tokenizer = source or config.data.tokenizer
    if tokenizer is not None:
      directory = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer)
      for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(directory, name)):
          shutil.copyfile(os.path.join(directory, name), os.path.join(partial, name))
    os.chmod(partial, 0o777 & ~umask())  # mkdtemp makes it the user's alone.
    os.replace(partial, out)  # Over an empty directory too.
  except (OSError, SafetensorError) as error:
    shutil.rmtree(partial, ignore_errors=True)
    raise ConfigError(f"{out!r} cannot be written: {_reason(error)}") from None
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise
  return sorted(os.listdir(out))



def _reason(error: Exception) -> str:
  """Why a write failed, as the operating system said it (safetensors words it in its own)."""
  if isinstance(error, OSError):
    return error.strerror or str(error)
  return str(error).split("I/O error: ")[-1].split(" (os error")[0]


def main(argv: Optional[list[str]] = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jaxoffload.train.export", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("checkpoint", help="a run's checkpoint.dir, or one step directory in it")
  parser.add_argument("out", help="the Hugging Face checkpoint directory to write")
  parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                      help="dtype of the tensors on disk (default: the source checkpoint's, "
                           "else bfloat16)")
  args = parser.parse_args(argv)
  try:
    files = export(args.checkpoint, args.out, args.dtype)
  except (ConfigError, CheckpointError) as error:
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2) from None
  print(f"wrote {args.out}: {', '.join(files)}")


if __name__ == "__main__":
  main()
