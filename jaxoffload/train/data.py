"""Training and held-out tokens: synthetic sequences, or a tokenized corpus.

Every batch is a pure function of the seed and the step number, so a resumed
run sees exactly the tokens an uninterrupted one would have seen. The text
path needs no download: without ``data.path`` it reads ``corpus.txt``, a
fixed text shipped with the package (made by ``tests/fixtures/make_corpus.py``),
so the default run's loss curve does not move when the code changes.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxoffload.train import corpus
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.tokenizer import (TOKENIZER_FILE, Tokenizer, byte_tokenizer,
                                        load_tokenizer)

Batches = Callable[[int], np.ndarray]  # step -> tokens [batch, seq_length].
# The held-out batches of synthetic data come from their own random stream.
_EVAL_STREAM = 1


@dataclasses.dataclass(frozen=True)
class Data:
  """Where a run's tokens come from.

  Attributes:
    train: step -> that step's global batch, [global_batch_size, seq_length].
    eval: i -> the i-th held-out batch, [micro_batch_size, seq_length]; None
      without evaluation (``eval.interval`` 0).
    tokenizer: the text's tokenizer; None for synthetic data.
  """

  train: Batches
  eval: Optional[Batches]
  tokenizer: Optional[Tokenizer]


def make(config: Config) -> Data:
  """The batches ``data.*`` and ``eval.*`` ask for.

  Raises:
    ConfigError: naming the file or key, for data that cannot be read, a
      tokenizer larger than the model's vocabulary, or too little text.
  """
  t, m, e = config.train, config.model, config.eval
  evaluate = e.interval > 0
  if config.data.dataset == "synthetic":
    train = lambda step: synthetic_batch(t.seed, step, t.global_batch_size, m.seq_length,
                                         m.vocab_size)
    held_out = lambda i: synthetic_batch(t.seed + _EVAL_STREAM, i, t.micro_batch_size,
                                         m.seq_length, m.vocab_size)
    return Data(train, held_out if evaluate else None, None)
  tokenizer = tokenizer_for(config)
  if tokenizer.vocab_size > m.vocab_size:
    raise ConfigError(f"the tokenizer has {tokenizer.vocab_size:,} ids; model.vocab_size is "
                      f"{m.vocab_size:,}")
  if config.data.path is None:
    stream = np.asarray(tokenizer.encode_batch([shipped_corpus()])[0], np.uint32)
  else:
    stream = corpus.tokens(config.data.path, tokenizer, config.data.text_field)
  if not evaluate:
    train_tokens, held_out_tokens = _long_enough(stream, m.seq_length), None
  else:
    train_tokens, held_out_tokens = corpus.split(stream, tokenizer.eos_id, e.fraction,
                                                 m.seq_length)
  train = lambda step: text_batch(train_tokens, t.seed, step, t.global_batch_size, m.seq_length)
  held_out = lambda i: text_batch(held_out_tokens, t.seed, i, t.micro_batch_size, m.seq_length,
                                  stream=_EVAL_STREAM)
  return Data(train, held_out if evaluate else None, tokenizer)


def tokenizer_for(config: Config) -> Tokenizer:
  """``data.tokenizer``; else the ``tokenizer.json`` of ``model.hf_checkpoint``; else bytes."""
  path = config.data.tokenizer
  checkpoint = config.model.hf_checkpoint
  if path is None and checkpoint and os.path.exists(os.path.join(checkpoint, TOKENIZER_FILE)):
    path = checkpoint
  return byte_tokenizer() if path is None else load_tokenizer(path, config.data.eos_token)


def shipped_corpus() -> str:
  """The fixed text shipped with the package."""
  return importlib.resources.files("jaxoffload.train").joinpath("corpus.txt").read_text("utf-8")


def _long_enough(stream: np.ndarray, seq_len: int) -> np.ndarray:
  if len(stream) < seq_len:
    raise ConfigError(f"the text holds {len(stream)} tokens; one sequence of model.seq_length "
                      f"needs {seq_len}")
  return stream


def text_batch(tokens: np.ndarray, seed: int, step: int, batch: int, seq_len: int,
               stream: Optional[int] = None) -> np.ndarray:
  """``batch`` windows of ``seq_len`` tokens at offsets drawn from (seed, step[, stream])."""
  rng = np.random.default_rng([seed, step] if stream is None else [seed, step, stream])
  starts = rng.integers(0, len(tokens) - seq_len + 1, size=batch)
  return np.stack([np.asarray(tokens[s:s + seq_len], np.int32) for s in starts])


def synthetic_batch(seed: int, step: int, batch: int, seq_len: int,
                    vocab_size: int) -> np.ndarray:
  """Sequences that count up by a stride from a random start, drawn from (seed, step).

  The next token follows from the current one and the sequence's stride, so a
  model that learns shows a falling loss within a few dozen steps.
  """
  key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
  start_key, stride_key = jax.random.split(key)
  start = jax.random.randint(start_key, (batch, 1), 0, vocab_size)
  stride = jax.random.randint(stride_key, (batch, 1), 1, 4)
  return np.asarray((start + stride * jnp.arange(seq_len)[None, :]) % vocab_size)
