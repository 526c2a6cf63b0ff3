"""The text study's measurement: the byte tokenizer, held-out documents as a complement split,
evaluation masks that do not depend on the run's seed, the same targets scored inside windows
of L, 2L, 4L, and the unigram/bigram baselines, on a small corpus written here."""
import math

import ml_collections
import numpy as np
import pytest

from posjax.data import sources
from posjax.data import text as text_data
from posjax.data.tokenizers import load_tokenizer
from posjax.study import held_out


def test_byte_tokenizer_is_one_token_per_byte():
    tok = load_tokenizer("bytes")
    assert tok.vocab_size == 261 and tok.special.as_tuple() == (0, 1, 2, 3, 4)
    text = "Speak, speak.\nthé [MASK]"
    ids = tok.encode(text).ids
    assert ids.tolist() == [5 + b for b in text.encode("utf-8")]   # specials are not matched
    assert tok.decode(ids) == text


def test_a_complement_split_is_every_document_the_slice_leaves_out():
    assert sources.split_indices("play[::4]", 10).tolist() == [0, 4, 8]
    assert sources.split_indices("~play[::4]", 10).tolist() == [1, 2, 3, 5, 6, 7, 9]
    assert sources.split_indices("~play[2:5]", 6).tolist() == [0, 1, 5]
    with pytest.raises(ValueError, match="MLM text-file pipeline only"):
        sources.split_range("~test[::5]", 10)


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis"]
    speeches = [" ".join(rng.choice(words, size=rng.integers(8, 30))) + ".\n"
                for _ in range(120)]
    path = tmp_path / "play.txt"
    path.write_text("\n".join(speeches))
    config = ml_collections.ConfigDict({"data": text_data.default_mlm_data_config()})
    config.data.update(source="text_files", text_files={"play": str(path)},
                       train_split="~play[::10]", test_split="play[::10]", tokenizer="bytes",
                       unk_marker="", max_seq_length=32)
    return config


def test_held_out_documents_and_seed_independent_masks(corpus):
    data = corpus.data
    text_data.validate_mlm_data_config(data)
    train = list(text_data.open_documents(data, data.train_split))
    test = list(text_data.open_documents(data, data.test_split))
    assert len(train) == 108 and len(test) == 12 and not set(train) & set(test)
    batches = [next(text_data.make_mlm_pipeline(data, split="test", batch_size=4, seed=seed,
                                                train=False).iterator) for seed in (1, 7)]
    for k in batches[0]:
        np.testing.assert_array_equal(batches[0][k], batches[1][k])


def test_the_same_targets_are_scored_inside_every_window(corpus):
    tokenizer = load_tokenizer("bytes")
    spec = text_data.mask_spec(corpus.data, tokenizer)
    tokens = held_out.stream(corpus.data, corpus.data.test_split, tokenizer)
    assert np.sum(tokens == tokenizer.special.sep) == 12
    cores = held_out.masked_cores(tokens, 32, 0, spec)
    assert len(cores) == len(tokens) // 30
    windows = {f: held_out.window_batch(tokens, cores, 32, f, tokenizer.special)
               for f in (1, 2, 4)}
    for f, w in windows.items():
        assert w["input_ids"].shape == (len(cores), 32 * f)
        assert np.all(w["input_ids"][:, 0] == tokenizer.special.cls)
        rows = np.arange(len(cores))[:, None]
        masked = w["input_ids"][rows, w["masked_positions"]]
        real = w["masked_weights"] > 0
        # the same target ids and the same replacements at every window size
        np.testing.assert_array_equal(w["masked_ids"], windows[1]["masked_ids"])
        np.testing.assert_array_equal(np.where(real, masked, 0),
                                      np.where(real, windows[1]["input_ids"][
                                          rows, windows[1]["masked_positions"]], 0))
        # what a target stood for is the stream's token there
        original = held_out.window_batch(tokens, [
            {**c, "input_ids": tokens[j * 30:(j + 1) * 30]} for j, c in enumerate(cores)],
            32, f, tokenizer.special)["input_ids"]
        np.testing.assert_array_equal(np.where(real, original[rows, w["masked_positions"]], 0),
                                      np.where(real, w["masked_ids"], 0))
    other = held_out.masked_cores(tokens, 32, 1, spec)
    assert any(not np.array_equal(a["masked_positions"], b["masked_positions"])
               for a, b in zip(cores, other))                        # draws differ


def test_baselines_are_the_cross_entropy_of_those_targets(corpus):
    b = held_out.baselines(corpus, draws=2)
    assert b["bigram"] < b["unigram"] < math.log(261)
    # the unigram recomputed by hand with the chosen smoothing
    tokenizer = load_tokenizer("bytes")
    spec = text_data.mask_spec(corpus.data, tokenizer)
    train = held_out.stream(corpus.data, corpus.data.train_split, tokenizer)
    tokens = held_out.stream(corpus.data, corpus.data.test_split, tokenizer)
    counts = np.bincount(train, minlength=261) + b["unigram_alpha"]
    p = counts / counts.sum()
    targets = [c["masked_ids"][c["masked_weights"] > 0] for d in range(2)
               for c in held_out.masked_cores(tokens, 32, d, spec)]
    y = np.concatenate(targets)
    assert len(y) == b["num_predictions"]
    assert b["unigram"] == pytest.approx(-np.mean(np.log(p[y])))
