"""Training tokens: synthetic sequences, or text through a byte-level tokenizer.

Every batch is a pure function of the seed and the step number, so a resumed
run sees exactly the tokens an uninterrupted one would have seen.

The text path needs no download: its default corpus is ``corpus.txt``, a fixed
text shipped with the package (made by ``tests/fixtures/make_corpus.py``), so
the default run's loss curve does not move when the code changes;
``data.text_file`` names any text file instead. The tokenizer maps each UTF-8
byte to its value (ids 0-255): no vocabulary file, and any text round-trips.
"""

from __future__ import annotations

import importlib.resources
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxoffload.train.config import Config, ConfigError

Batches = Callable[[int], np.ndarray]  # step -> tokens [global_batch_size, seq_length].
BYTE_VOCAB_SIZE = 256


def batches(config: Config) -> Batches:
  """The function from a step number to that step's tokens, for ``data.*``.

  Raises:
    ConfigError: naming ``data.text_file`` when it cannot be read or is shorter
      than one sequence.
  """
  t, m = config.train, config.model
  if config.data.dataset == "synthetic":
    return lambda step: synthetic_batch(t.seed, step, t.global_batch_size, m.seq_length,
                                        m.vocab_size)
  tokens = corpus_tokens(config.data.text_file, m.seq_length)
  return lambda step: text_batch(tokens, t.seed, step, t.global_batch_size, m.seq_length)


def encode(text: str) -> np.ndarray:
  """Token ids of ``text``: its UTF-8 bytes.

  Example:
    >>> decode(encode("héllo")) == "héllo"
    True
  """
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(tokens) -> str:
  """The text of byte token ids; invalid UTF-8 sequences become U+FFFD."""
  return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def shipped_corpus() -> str:
  """The fixed text shipped with the package."""
  return importlib.resources.files("jaxoffload.train").joinpath("corpus.txt").read_text("utf-8")


def corpus_tokens(text_file: Optional[str], min_tokens: int) -> np.ndarray:
  """The byte tokens of ``text_file`` (None: the shipped corpus).

  Raises:
    ConfigError: naming the file, when it cannot be read as UTF-8 or holds
      fewer than ``min_tokens`` bytes (one sequence).
  """
  if text_file is None:
    text, name = shipped_corpus(), "the shipped corpus"
  else:
    try:
      with open(text_file, encoding="utf-8") as f:
        text = f.read()
    except (OSError, UnicodeDecodeError) as error:
      raise ConfigError(f"data.text_file {text_file!r} cannot be read as UTF-8 text: "
                        f"{error}") from None
    name = f"data.text_file {text_file!r}"
  tokens = encode(text)
  if len(tokens) < min_tokens:
    raise ConfigError(f"{name} holds {len(tokens)} bytes; one sequence of model.seq_length "
                      f"needs {min_tokens}")
  return tokens


def text_batch(tokens: np.ndarray, seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
  """``batch`` windows of ``seq_len`` tokens at offsets drawn from (seed, step)."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(tokens) - seq_len + 1, size=batch)
  return np.stack([tokens[s:s + seq_len] for s in starts])


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
