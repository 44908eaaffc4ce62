"""Training tokens: the byte tokenizer, the shipped corpus, and batches fixed by seed and step."""

import numpy as np
import pytest

from jaxoffload import data
from jaxoffload.config import ConfigError, load_config


def test_byte_tokens_round_trip_any_text():
  text = "Offload 25% of Adam's moments: μ and ν → pinned_host.\n"
  tokens = data.encode(text)
  assert tokens.max() < data.BYTE_VOCAB_SIZE and len(tokens) == len(text.encode("utf-8"))
  assert data.decode(tokens) == text


def test_package_corpus_is_the_packages_own_source():
  corpus = data.package_corpus()
  assert len(corpus) > 50_000
  assert "def scale_by_offloaded_adam(" in corpus and "class Monitor:" in corpus


def test_text_batches_are_windows_of_the_corpus_fixed_by_seed_and_step():
  tokens = data.corpus_tokens(None, 32)
  batch = np.asarray(data.text_batch(tokens, seed=0, step=7, batch=4, seq_len=32))
  assert batch.shape == (4, 32)
  haystack = data.decode(tokens)
  assert all(data.decode(row) in haystack for row in batch)
  np.testing.assert_array_equal(batch, data.text_batch(tokens, seed=0, step=7, batch=4, seq_len=32))
  assert not np.array_equal(batch, data.text_batch(tokens, seed=0, step=8, batch=4, seq_len=32))


def test_a_users_text_file_is_read(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_text("abcdefgh" * 16)
  config = load_config(None, ["data.dataset=text", f"data.text_file={path}", "model.seq_length=8"])
  assert data.decode(data.corpus_tokens(config.data.text_file, 8)) == "abcdefgh" * 16


@pytest.mark.parametrize("overrides, message", [
    (["data.dataset=text", "data.text_file=/nonexistent/corpus.txt"],
     r"data.text_file '/nonexistent/corpus.txt' cannot be read as UTF-8 text"),
    (["data.dataset=text", "model.vocab_size=128"],
     r"data.dataset=text needs model.vocab_size >= 256 \(byte tokens\), got 128"),
    (["data.text_file=corpus.txt"], r"data.text_file is set but data.dataset is 'synthetic'"),
    (["data.dataset=wikipedia"], r"data.dataset must be one of \['synthetic', 'text'\]"),
])
def test_bad_data_settings_name_the_key(overrides, message):
  with pytest.raises(ConfigError, match=message):
    load_config(None, overrides)


def test_a_text_file_shorter_than_a_sequence_is_refused(tmp_path):
  path = tmp_path / "short.txt"
  path.write_text("tiny")
  with pytest.raises(ConfigError, match=r"holds 4 bytes; one sequence of model.seq_length needs 64"):
    load_config(None, ["data.dataset=text", f"data.text_file={path}"])
