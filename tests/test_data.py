"""Training tokens: the byte tokenizer, the shipped corpus, and batches fixed by seed and step."""

import hashlib
import importlib.util

import numpy as np
import pytest

from jaxoffload.train import ConfigError, data, load_config, resolve


def test_byte_tokens_round_trip_any_text():
  text = "Offload 25% of Adam's moments: μ and ν → pinned_host.\n"
  tokens = data.encode(text)
  assert tokens.max() < data.BYTE_VOCAB_SIZE and len(tokens) == len(text.encode("utf-8"))
  assert data.decode(tokens) == text


def test_the_shipped_corpus_is_what_its_script_makes():
  # A fixed text, so that the default text run's loss curve is a regression signal:
  # changing it means changing tests/fixtures/make_corpus.py and remaking it.
  spec = importlib.util.spec_from_file_location("make_corpus", "tests/fixtures/make_corpus.py")
  maker = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(maker)
  corpus = data.shipped_corpus()
  assert corpus == maker.corpus()
  assert hashlib.sha256(corpus.encode()).hexdigest() == (
      "5fc961fe3c3f87bca3306bd06a8431cb473b2a2c86150c36c8d0130a3a29634f")


def test_text_batches_are_windows_of_the_corpus_fixed_by_seed_and_step():
  tokens = data.corpus_tokens(None, 32)
  batch = data.text_batch(tokens, seed=0, step=7, batch=4, seq_len=32)
  assert batch.shape == (4, 32)
  haystack = data.decode(tokens)
  assert all(data.decode(row) in haystack for row in batch)
  np.testing.assert_array_equal(batch, data.text_batch(tokens, seed=0, step=7, batch=4, seq_len=32))
  assert not np.array_equal(batch, data.text_batch(tokens, seed=0, step=8, batch=4, seq_len=32))


def test_a_users_text_file_is_read(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_text("abcdefgh" * 16)
  config = load_config(None, ["data.dataset=text", f"data.text_file={path}", "model.seq_length=8"])
  batch = resolve(config).batches(0)
  assert batch.shape == (8, 8) and all(data.decode(row) in "abcdefgh" * 2 for row in batch)


@pytest.mark.parametrize("overrides, message", [
    (["data.dataset=text", "model.vocab_size=128"],
     r"data.dataset=text needs model.vocab_size >= 256 \(byte tokens\), got 128"),
    (["data.text_file=corpus.txt"], r"data.text_file is set but data.dataset is 'synthetic'"),
    (["data.dataset=wikipedia"], r"data.dataset must be one of \['synthetic', 'text'\]"),
])
def test_bad_data_settings_name_the_key(overrides, message):
  with pytest.raises(ConfigError, match=message):
    load_config(None, overrides)


def test_an_unreadable_text_file_is_named(tmp_path):
  config = load_config(None, ["data.dataset=text", "data.text_file=/nonexistent/corpus.txt"])
  with pytest.raises(ConfigError, match=r"data.text_file '/nonexistent/corpus.txt' cannot be read "
                                        r"as UTF-8 text"):
    resolve(config)
  binary = tmp_path / "weights.bin"
  binary.write_bytes(b"\xff\xfe\x00" * 40)
  with pytest.raises(ConfigError, match=r"cannot be read as UTF-8 text"):
    resolve(load_config(None, ["data.dataset=text", f"data.text_file={binary}"]))


def test_a_text_file_shorter_than_a_sequence_is_refused(tmp_path):
  path = tmp_path / "short.txt"
  path.write_text("tiny")
  with pytest.raises(ConfigError, match=r"holds 4 bytes; one sequence of model.seq_length needs 64"):
    resolve(load_config(None, ["data.dataset=text", f"data.text_file={path}"]))
