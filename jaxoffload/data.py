"""Training tokens: synthetic sequences, or real text through a byte-level tokenizer.

Every batch is a pure function of the seed and the step number, so a resumed
run sees exactly the tokens an uninterrupted one would have seen.

The text path needs no download: its default corpus is the jaxoffload
package's own source (prose docstrings and code, over 100 KB), read from the
installed package; ``data.text_file`` names any text file instead. The
tokenizer maps each UTF-8 byte to its value (ids 0-255), so it needs no
vocabulary file and round-trips any text.
"""

from __future__ import annotations

import functools
import importlib.resources
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

BYTE_VOCAB_SIZE = 256


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


def package_corpus() -> str:
  """The jaxoffload package's Python source, concatenated in a fixed order."""
  files = sorted((f for f in importlib.resources.files("jaxoffload").iterdir()
                  if f.name.endswith(".py")), key=lambda f: f.name)
  return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


@functools.lru_cache(maxsize=4)
def corpus_tokens(text_file: Optional[str], min_tokens: int) -> np.ndarray:
  """The tokens of ``text_file`` (None: the package corpus).

  Raises:
    ValueError: naming the file, when it cannot be read or holds fewer than
      ``min_tokens`` bytes (one sequence).
  """
  if text_file is None:
    text, name = package_corpus(), "the package corpus"
  else:
    try:
      with open(text_file, encoding="utf-8") as f:
        text = f.read()
    except (OSError, UnicodeDecodeError) as error:
      raise ValueError(f"data.text_file {text_file!r} cannot be read as UTF-8 text: "
                       f"{error}") from None
    name = f"data.text_file {text_file!r}"
  tokens = encode(text)
  if len(tokens) < min_tokens:
    raise ValueError(f"{name} holds {len(tokens)} bytes; one sequence of model.seq_length "
                     f"needs {min_tokens}")
  return tokens


def text_batch(tokens: np.ndarray, seed: int, step: int, batch: int, seq_len: int) -> jax.Array:
  """``batch`` windows of ``seq_len`` tokens at offsets drawn from (seed, step)."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(tokens) - seq_len + 1, size=batch)
  return jnp.asarray(np.stack([tokens[s:s + seq_len] for s in starts]))


def synthetic_batch(seed: int, step: int, batch: int, seq_len: int, vocab_size: int) -> jax.Array:
  """Sequences that count up by a stride from a random start, drawn from (seed, step).

  The next token follows from the current one and the sequence's stride, so a
  model that learns shows a falling loss within a few dozen steps.
  """
  key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
  start_key, stride_key = jax.random.split(key)
  start = jax.random.randint(start_key, (batch, 1), 0, vocab_size)
  stride = jax.random.randint(stride_key, (batch, 1), 1, 4)
  return (start + stride * jnp.arange(seq_len)[None, :]) % vocab_size
