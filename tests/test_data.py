"""Training tokens: tokenizers, corpora and their cache, the held-out split, batches fixed by step."""

import hashlib
import importlib.util
import json

import numpy as np
import pytest

from jaxoffload.train import ConfigError, corpus, data, load_config, resolve
from jaxoffload.train.tokenizer import byte_tokenizer, load_tokenizer

TOKENIZER = "tests/fixtures/tiny_llama"


def test_byte_tokens_round_trip_any_text():
  text = "Offload 25% of Adam's moments: μ and ν → pinned_host.\n"
  bytes_ = byte_tokenizer()
  [ids] = bytes_.encode_batch([text])
  assert max(ids) < bytes_.vocab_size and len(ids) == len(text.encode("utf-8"))
  assert bytes_.decode(ids) == text and bytes_.eos_id == 0


def test_the_shipped_corpus_is_what_its_script_makes():
  # A fixed text, so that the default text run's loss curve is a regression signal:
  # changing it means changing tests/fixtures/make_corpus.py and remaking it.
  spec = importlib.util.spec_from_file_location("make_corpus", "tests/fixtures/make_corpus.py")
  maker = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(maker)
  text = data.shipped_corpus()
  assert text == maker.corpus()
  assert hashlib.sha256(text.encode()).hexdigest() == (
      "5fc961fe3c3f87bca3306bd06a8431cb473b2a2c86150c36c8d0130a3a29634f")


def test_text_batches_are_windows_of_the_corpus_fixed_by_seed_and_step():
  tokens = np.asarray(byte_tokenizer().encode_batch([data.shipped_corpus()])[0], np.uint32)
  batch = data.text_batch(tokens, seed=0, step=7, batch=4, seq_len=32)
  assert batch.shape == (4, 32) and batch.dtype == np.int32
  haystack = data.shipped_corpus()
  assert all(byte_tokenizer().decode(row) in haystack for row in batch)
  np.testing.assert_array_equal(batch, data.text_batch(tokens, seed=0, step=7, batch=4, seq_len=32))
  assert not np.array_equal(batch, data.text_batch(tokens, seed=0, step=8, batch=4, seq_len=32))


def write_corpus(tmp_path):
  (tmp_path / "a.txt").write_text("first document " * 20)
  (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"line {i} " * 10, "id": i})
                                              for i in range(5)) + "\n")
  return tmp_path


def test_a_corpus_of_files_is_documents_with_eos_between(tmp_path):
  write_corpus(tmp_path)
  tokenizer = load_tokenizer(TOKENIZER)
  stream = np.asarray(corpus.tokens(str(tmp_path), tokenizer, log=lambda _: None))
  texts = ["first document " * 20] + [f"line {i} " * 10 for i in range(5)]
  want = []
  for ids in tokenizer.encode_batch(texts):
    want += ([tokenizer.eos_id] if want else []) + ids
  np.testing.assert_array_equal(stream, want)
  assert stream[0] != tokenizer.eos_id and stream[-1] != tokenizer.eos_id
  # A glob names the same files in the same order.
  np.testing.assert_array_equal(corpus.tokens(str(tmp_path / "*.*"), tokenizer,
                                              log=lambda _: None), stream)


def test_the_tokens_are_cached_beside_the_data_and_reused(tmp_path):
  write_corpus(tmp_path)
  logged = []
  first = corpus.tokens(str(tmp_path), byte_tokenizer(), log=logged.append)
  cached = list((tmp_path / corpus.CACHE_DIR).iterdir())
  assert len(cached) == 1 and "documents cached in" in logged[-1]
  logged.clear()
  again = corpus.tokens(str(tmp_path), byte_tokenizer(), log=logged.append)
  assert logged == [] and isinstance(again, np.memmap)
  np.testing.assert_array_equal(again, first)
  # Another tokenizer, or a changed file, is another cache.
  corpus.tokens(str(tmp_path), load_tokenizer(TOKENIZER), log=lambda _: None)
  (tmp_path / "a.txt").write_text("changed")
  corpus.tokens(str(tmp_path), byte_tokenizer(), log=lambda _: None)
  assert len(list((tmp_path / corpus.CACHE_DIR).iterdir())) == 3


def test_the_held_out_split_is_disjoint_and_cut_at_a_document(tmp_path):
  write_corpus(tmp_path)
  config = load_config(None, ["data.dataset=text", f"data.path={tmp_path}", "model.seq_length=8",
                              "eval.interval=5", "eval.fraction=0.3", "train.global_batch_size=4",
                              "train.micro_batch_size=2"])
  stream = np.asarray(corpus.tokens(str(tmp_path), byte_tokenizer(), log=lambda _: None))
  train, held_out = corpus.split(stream, 0, 0.3, 8)
  # The two parts tile the stream, the cut just after an end-of-sequence.
  np.testing.assert_array_equal(np.concatenate([train, held_out]), stream)
  assert train[-1] == 0 and held_out[0] != 0
  assert abs(len(held_out) / len(stream) - 0.3) < 0.1
  # Training batches are windows of the first part, held-out ones of the second.
  run = resolve(config).data
  np.testing.assert_array_equal(run.train(3), data.text_batch(train, 0, 3, 4, 8))
  np.testing.assert_array_equal(run.eval(1), data.text_batch(held_out, 0, 1, 2, 8, stream=1))


@pytest.mark.parametrize("content, message", [
    ('{"text": "fine"}\nnot json\n', r"b.jsonl:2: not a JSON object"),
    ('{"body": "no text field"}\n', r"b.jsonl:1: no string under data.text_field 'text'"),
])
def test_a_bad_jsonl_line_is_named(tmp_path, content, message):
  (tmp_path / "b.jsonl").write_text(content)
  with pytest.raises(ConfigError, match=message):
    corpus.tokens(str(tmp_path / "b.jsonl"), byte_tokenizer(), log=lambda _: None)


def test_a_tokenizer_names_its_end_of_sequence_token(tmp_path):
  tokenizer = load_tokenizer(TOKENIZER)
  assert tokenizer.eos_id == 2 and tokenizer.vocab_size == 256
  assert load_tokenizer(f"{TOKENIZER}/tokenizer.json", eos_token="<s>").eos_id == 1
  (tmp_path / "tokenizer.json").write_bytes(open(f"{TOKENIZER}/tokenizer.json", "rb").read())
  with pytest.raises(ConfigError, match="no tokenizer_config.json beside it names an eos_token"):
    load_tokenizer(str(tmp_path))
  with pytest.raises(ConfigError, match="the end-of-sequence token '<eos>' is not in"):
    load_tokenizer(str(tmp_path), eos_token="<eos>")
  (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
  with pytest.raises(ConfigError, match="cannot be read as a tokenizer.json"):
    load_tokenizer(str(tmp_path), eos_token="</s>")


@pytest.mark.parametrize("overrides, message", [
    (["data.dataset=text", "model.vocab_size=128"],
     r"data.dataset=text needs model.vocab_size >= 256 \(byte tokens\), got 128"),
    (["data.path=corpus.txt"], r"data.path is set but data.dataset is 'synthetic'"),
    (["data.dataset=wikipedia"], r"data.dataset must be one of \['synthetic', 'text'\]"),
    (["eval.fraction=0.9"], r"eval.fraction must be in \(0, 0.5\], got 0.9"),
])
def test_bad_data_settings_name_the_key(overrides, message):
  with pytest.raises(ConfigError, match=message):
    load_config(None, overrides)


def test_unreadable_or_short_text_is_named(tmp_path):
  with pytest.raises(ConfigError, match=r"data.path '/nonexistent/corpus.txt' names no file"):
    resolve(load_config(None, ["data.dataset=text", "data.path=/nonexistent/corpus.txt"]))
  binary = tmp_path / "weights.bin"
  binary.write_bytes(b"\xff\xfe\x00" * 40)
  with pytest.raises(ConfigError, match=r"cannot be read as UTF-8 text"):
    resolve(load_config(None, ["data.dataset=text", f"data.path={binary}"]))
  short = tmp_path / "short.txt"
  short.write_text("tiny")
  with pytest.raises(ConfigError, match=r"the text holds 4 tokens; one sequence of "
                                        r"model.seq_length needs 64"):
    resolve(load_config(None, ["data.dataset=text", f"data.path={short}"]))


def test_a_setup_without_data_reads_none_and_compiles_for_the_batches_shape():
  # The planner resolves hundreds of settings: none of them reads the corpus.
  missing = load_config(None, ["data.dataset=text", "data.path=/nonexistent/corpus.txt"])
  assert resolve(missing, with_data=False).data is None
  config = load_config(None, ["data.dataset=text", "train.global_batch_size=4",
                              "train.micro_batch_size=2"])
  tokens = resolve(config).global_batch(0)
  shape = resolve(config, with_data=False).batch_shape
  assert (shape.shape, shape.dtype, shape.sharding) == (tokens.shape, tokens.dtype,
                                                        tokens.sharding)
  assert tokens.shape == (4, config.model.seq_length)


def test_a_tokenizer_larger_than_the_model_is_refused():
  config = load_config(None, ["data.dataset=text", f"data.tokenizer={TOKENIZER}",
                              "model.vocab_size=128"])
  with pytest.raises(ConfigError, match="the tokenizer has 256 ids; model.vocab_size is 128"):
    resolve(config)
