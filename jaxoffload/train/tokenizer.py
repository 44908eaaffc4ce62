"""Text to token ids: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library, or bytes.

The byte tokenizer maps each UTF-8 byte to its value (ids 0-255): it needs no
file and round-trips any text; its end-of-sequence id is 0, a byte no text
holds. A ``tokenizer.json`` names its end-of-sequence token in the
``tokenizer_config.json`` beside it (as transformers saves them), or
``data.eos_token`` names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Callable, Optional, Sequence

import numpy as np

from jaxoffload.train.config import ConfigError

BYTE_VOCAB_SIZE = 256
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """What the data pipeline needs of a tokenizer.

  Attributes:
    vocab_size: ids run from 0 to vocab_size - 1.
    eos_id: the end-of-sequence id put between documents.
    fingerprint: changes whenever the ids of some text would.
    encode_batch: texts -> their ids.
    decode: ids -> text.
  """

  vocab_size: int
  eos_id: int
  fingerprint: str
  encode_batch: Callable[[Sequence[str]], list[list[int]]]
  decode: Callable[[Sequence[int]], str]


def byte_tokenizer() -> Tokenizer:
  """UTF-8 bytes as ids; invalid sequences decode to U+FFFD."""
  return Tokenizer(
      vocab_size=BYTE_VOCAB_SIZE, eos_id=0, fingerprint="bytes",
      encode_batch=lambda texts: [list(text.encode("utf-8")) for text in texts],
      decode=lambda ids: bytes(np.asarray(ids, np.uint8).tolist()).decode("utf-8", "replace"))


def load_tokenizer(path: str, eos_token: Optional[str] = None) -> Tokenizer:
  """The tokenizer in ``path``: a ``tokenizer.json``, or a directory holding one.

  Raises:
    ConfigError: naming the file, when it cannot be read or names no
      end-of-sequence token.
  """
  import tokenizers

  file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
  try:
    with open(file, "rb") as f:
      raw = f.read()
    tokenizer = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
  except Exception as error:  # The tokenizers library raises plain Exceptions for a bad file.
    raise ConfigError(f"data.tokenizer {file!r} cannot be read as a tokenizer.json: "
                      f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
                      ) from None
  eos_token = eos_token or _configured_eos(os.path.dirname(file))
  if eos_token is None:
    raise ConfigError(f"{file}: no {TOKENIZER_CONFIG_FILE} beside it names an eos_token; set "
                      f"data.eos_token")
  eos_id = tokenizer.token_to_id(eos_token)
  if eos_id is None:
    raise ConfigError(f"{file}: the end-of-sequence token {eos_token!r} is not in its vocabulary")
  return Tokenizer(
      vocab_size=tokenizer.get_vocab_size(), eos_id=eos_id,
      fingerprint=hashlib.sha256(raw + eos_token.encode()).hexdigest(),
      encode_batch=lambda texts: [e.ids for e in tokenizer.encode_batch(
          list(texts), add_special_tokens=False)],
      decode=lambda ids: tokenizer.decode(list(ids)))


def _configured_eos(directory: str) -> Optional[str]:
  """The eos_token of the tokenizer_config.json in ``directory``, if any."""
  try:
    with open(os.path.join(directory, TOKENIZER_CONFIG_FILE)) as f:
      eos = json.load(f).get("eos_token")
  except (OSError, ValueError):
    return None
  # transformers writes either the token or {"content": token, ...}.
  return eos.get("content") if isinstance(eos, dict) else eos
