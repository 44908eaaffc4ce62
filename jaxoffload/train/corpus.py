"""A corpus as one stream of token ids: read, tokenized once, cached memory-mapped beside the data.

The corpus is a text file, a JSONL file (one document per line, its text
under ``data.text_field``), or a directory or glob of such files (``.jsonl``
by their ending, any other file as text). Documents are tokenized in batches
(the ``tokenizers`` library spreads each batch over the cores), joined with
the end-of-sequence token between them, and written once to
``.jaxoffload_cache/`` beside the data; later runs with the same files and
tokenizer map that file instead of tokenizing again.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import sys
import tempfile
import time
from typing import Iterator, Optional

import numpy as np

from jaxoffload.train.config import ConfigError
from jaxoffload.train.tokenizer import Tokenizer

CACHE_DIR = ".jaxoffload_cache"
_BATCH_DOCUMENTS = 512
_FORMAT = 2  # Bumped when what the cache holds changes.


def corpus_files(path: str) -> list[str]:
  """The files ``data.path`` names, in a fixed order.

  Raises:
    ConfigError: naming the path, when it names no readable file.
  """
  if os.path.isdir(path):
    files = sorted(os.path.join(root, name) for root, dirs, names in os.walk(path)
                   for name in names if CACHE_DIR not in root.split(os.sep))
  elif glob.has_magic(path):
    files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
  else:
    files = [path] if os.path.isfile(path) else []
  if not files:
    raise ConfigError(f"data.path {path!r} names no file")
  return files


def documents(files: list[str], text_field: str) -> Iterator[tuple[str, int]]:
  """Each document's text and the bytes of file it took, in file order.

  Raises:
    ConfigError: naming the file (and line), when it cannot be read as UTF-8
      text or a JSONL line has no string under ``text_field``.
  """
  for file in files:
    try:
      with open(file, encoding="utf-8") as f:
        if not file.endswith(".jsonl"):
          text = f.read()
          if text:  # An empty file is no document.
            yield text, len(text.encode("utf-8"))
          continue
        for number, line in enumerate(f, start=1):
          text = _jsonl_text(file, number, line, text_field) if line.strip() else ""
          if text:  # A blank line, or an empty text: no document.
            yield text, len(line.encode("utf-8"))
    except (OSError, UnicodeDecodeError) as error:
      raise ConfigError(f"data.path file {file!r} cannot be read as UTF-8 text: {error}") from None


def _jsonl_text(file: str, number: int, line: str, text_field: str) -> str:
  try:
    record = json.loads(line)
  except ValueError:
    raise ConfigError(f"{file}:{number}: not a JSON object") from None
  text = record.get(text_field) if isinstance(record, dict) else None
  if not isinstance(text, str):
    raise ConfigError(f"{file}:{number}: no string under data.text_field {text_field!r}")
  return text


def cache_key(files: list[str], tokenizer: Tokenizer, text_field: str) -> str:
  """What decides a cache's tokens: the files as they are now, the tokenizer, the text field."""
  stats = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
  description = json.dumps([_FORMAT, stats, tokenizer.fingerprint, text_field])
  return hashlib.sha256(description.encode()).hexdigest()[:24]


def cache_path(path: str, key: str) -> str:
  """Where the tokens of ``data.path`` are cached: beside the data, else in the user's cache."""
  if os.path.isdir(path):
    beside = path
  else:
    # A file's own directory; a glob's deepest directory before its first pattern.
    parts = path.split(os.sep)
    fixed = parts[:next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts) - 1)]
    beside = os.sep.join(fixed) or ("/" if path.startswith(os.sep) else ".")
  directory = os.path.join(beside, CACHE_DIR)
  try:
    os.makedirs(directory, exist_ok=True)
    if os.access(directory, os.W_OK):
      return os.path.join(directory, f"{key}.tokens")
  except OSError:
    pass
  home = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
  os.makedirs(os.path.join(home, "jaxoffload"), exist_ok=True)
  return os.path.join(home, "jaxoffload", f"{key}.tokens")


def tokens(path: str, tokenizer: Tokenizer, text_field: str = "text",
           log=lambda line: print(line, file=sys.stderr)) -> np.ndarray:
  """The corpus ``path`` names as token ids (uint32, memory-mapped), end-of-sequence between
  documents; tokenized on the first call, read from the cache on later ones.

  Raises:
    ConfigError: naming the path, when its files hold no document.
  """
  files = corpus_files(path)
  cached = cache_path(path, cache_key(files, tokenizer, text_field))
  if not os.path.exists(cached):
    _write_cache(cached, path, files, tokenizer, text_field, log)
  return np.memmap(cached, dtype=np.uint32, mode="r")


def _write_cache(cached: str, path: str, files: list[str], tokenizer: Tokenizer,
                 text_field: str, log) -> None:
  """Tokenizes the documents into ``cached``, through a temporary file renamed when complete
  (removed, with the cache's directory where that is left empty, when it cannot be).

  Raises:
    ConfigError: naming ``path``, when its files hold no document or cannot be read, or the
      cache cannot be written (a full disk).
  """
  start, total = time.perf_counter(), sum(os.path.getsize(f) for f in files)
  uncacheable = lambda error: ConfigError(
      f"the tokens of data.path {path!r} cannot be cached in {os.path.dirname(cached)!r}: "
      f"{error.strerror}")
  try:
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(cached), suffix=".partial")
  except OSError as error:
    raise uncacheable(error) from None
  try:
    with os.fdopen(handle, "wb") as out:
      count = _tokenize(out, files, tokenizer, text_field,
                        lambda done: log(_progress(done, total, start)))
    if not count:  # Nothing to cache, nor to train on.
      raise ConfigError(f"data.path {path!r} holds no text: no document in its {len(files)} "
                        f"file{'s' if len(files) > 1 else ''}")
    os.replace(temporary, cached)
  except BaseException as error:
    os.remove(temporary)
    with contextlib.suppress(OSError):
      os.rmdir(os.path.dirname(cached))
    if isinstance(error, OSError):
      raise uncacheable(error) from None
    raise
  log(_progress(total, total, start) + f"; {count:,} documents cached in {cached}")


def _tokenize(out, files: list[str], tokenizer: Tokenizer, text_field: str, progress) -> int:
  """Writes the documents' ids to ``out``, end-of-sequence between them, calling
  ``progress(bytes read)`` after each batch; returns how many documents it wrote."""
  done, batch, count = 0, [], 0

  def flush():
    nonlocal count
    for ids in tokenizer.encode_batch(batch):
      if count:
        out.write(np.asarray([tokenizer.eos_id], np.uint32).tobytes())
      out.write(np.asarray(ids, np.uint32).tobytes())
      count += 1
    batch.clear()

  for text, size in documents(files, text_field):
    batch.append(text)
    done += size
    if len(batch) == _BATCH_DOCUMENTS:
      flush()
      progress(done)
  flush()
  return count


def _progress(done: int, total: int, start: float) -> str:
  share = done / total if total else 1.0
  bar = "#" * int(20 * share) + "." * (20 - int(20 * share))
  rate = done / max(time.perf_counter() - start, 1e-9) / 2**20
  return f"[{bar}] tokenized {done / 2**20:,.1f} of {total / 2**20:,.1f} MiB ({rate:,.1f} MiB/s)"


def split(stream: np.ndarray, eos_id: Optional[int], fraction: float, min_tokens: int
          ) -> tuple[np.ndarray, np.ndarray]:
  """The stream cut into training and held-out parts, the held-out one the last ``fraction``,
  cut at the document boundary nearest that point when there is one.

  Raises:
    ConfigError: when a part would hold fewer than ``min_tokens`` tokens.
  """
  cut = len(stream) - int(round(fraction * len(stream)))
  if eos_id is not None:
    boundaries = np.flatnonzero(np.asarray(stream) == eos_id)
    if len(boundaries):
      cut = int(boundaries[np.argmin(np.abs(boundaries - cut))]) + 1
  train, held_out = stream[:cut], stream[cut:]
  if min(len(train), len(held_out)) < min_tokens:
    raise ConfigError(f"eval.fraction={fraction} leaves {len(train):,} training and "
                      f"{len(held_out):,} held-out tokens; each part needs at least one "
                      f"sequence of model.seq_length ({min_tokens})")
  return train, held_out
