"""MLM input: document spans, packing that respects documents, 80/10/10 masking, resumption."""
import io
import json

import grain
import numpy as np
import pytest

from posjax.data import text
from posjax.data.tokenizers import Encoded

CLS, SEP, PAD, MASK, UNK = 2, 3, 0, 4, 1
SPECIALS = (PAD, UNK, CLS, SEP, MASK)


def fake_docs(lengths, seed=0):
    """Documents with ids >= 10 and every third token starting a word."""
    rng = np.random.default_rng(seed)
    return [Encoded(rng.integers(10, 50, n).astype(np.int32), np.arange(n) % 3 == 0)
            for n in lengths]


def pack(docs, length):
    spec = text.PackSpec(length, CLS, SEP, PAD)
    return list(text.PackIterDataset(grain.MapDataset.source(docs).to_iter_dataset(), spec))


def test_document_spans():
    data = b"a b\nc\n  \n\nd e\n \nf"
    spans = text.document_spans(io.BytesIO(data), "blank_line")
    assert [data[s:e].split() for s, e in spans] == [[b"a", b"b", b"c"], [b"d", b"e"], [b"f"]]
    spans = text.document_spans(io.BytesIO(data), "line")
    assert [data[s:e].strip() for s, e in spans] == [b"a b", b"c", b"d e", b"f"]


def test_packing_respects_documents():
    length = 16
    lengths = [5, 14, 3, 30, 0, 9, 2, 14, 15, 1]
    docs = fake_docs(lengths)
    seqs = pack(docs, length)
    pieces = []
    for i, s in enumerate(seqs):
        n = int(s["length"])
        ids = s["input_ids"]
        assert 2 < n <= length and ids[0] == CLS and ids[n - 1] == SEP
        assert (ids[n:] == PAD).all() and s["index"] == i
        body = ids[1:n]
        cuts = np.flatnonzero(body == SEP)
        start = 0
        for c in cuts:
            pieces.append(body[start:c])
            start = c + 1
    # Every document of <= L-2 tokens is one piece; the 30-token one is cut into 14 + 14 + 2.
    expected = []
    for d in docs:
        n = len(d.ids)
        if n == 0:
            continue
        if n <= length - 2:
            expected.append(d.ids)
        else:
            expected += [d.ids[i:i + length - 2] for i in range(0, n, length - 2)]
    assert [p.tolist() for p in pieces] == [e.tolist() for e in expected]
    # A document that does not fit in the space left starts a new sequence.
    assert [int(s["length"]) for s in seqs][:3] == [1 + 6, 1 + 15, 1 + 4]


def masking_spec(whole_word=False, m=8):
    return text.MaskSpec(mask_rate=0.15, max_predictions=m, mask_id=MASK, special_ids=SPECIALS,
                         vocab_size=60, whole_word=whole_word)


def test_masking_statistics_and_determinism():
    lengths = np.random.default_rng(1).integers(3, 46, 600)
    seqs = pack(fake_docs(lengths, seed=1), 48)
    spec = masking_spec(m=8)
    counts = {"mask": 0, "random": 0, "keep": 0}
    chosen_total = candidates_total = 0
    for s in seqs:
        out = text.seeded_mask(s, spec, 7)
        again = text.seeded_mask(s, spec, 7)
        assert all(np.array_equal(out[k], again[k]) for k in out)
        k = int(out["masked_weights"].sum())
        n_cand = int(((s["input_ids"] >= 10) & (np.arange(48) < s["length"])).sum())
        assert k == min(8, max(1, round(0.15 * n_cand)))
        pos = out["masked_positions"][:k]
        assert (np.diff(pos) > 0).all() and (out["masked_positions"][k:] == 0).all()
        assert np.array_equal(out["masked_ids"][:k], s["input_ids"][pos])
        assert not np.isin(s["input_ids"][pos], SPECIALS).any()
        unchanged = np.ones(48, bool)
        unchanged[pos] = False
        assert np.array_equal(out["input_ids"][unchanged], s["input_ids"][unchanged])
        new = out["input_ids"][pos]
        counts["mask"] += int((new == MASK).sum())
        counts["keep"] += int((new == s["input_ids"][pos]).sum())
        counts["random"] += int(((new != MASK) & (new != s["input_ids"][pos])).sum())
        assert not np.isin(new[new != MASK], SPECIALS).any()
        assert out["attention_mask"].sum() == s["length"]
        chosen_total += k
        candidates_total += n_cand
    total = sum(counts.values())
    assert abs(counts["mask"] / total - 0.8) < 0.03
    # "keep" also holds random draws that hit the original id (1/55 of 10%).
    assert abs(counts["random"] / total - 0.1 * 54 / 55) < 0.02
    assert abs(chosen_total / candidates_total - 0.15) < 0.01
    a = text.seeded_mask(seqs[0], spec, 7)
    b = text.seeded_mask(dict(seqs[0], index=np.int64(1)), spec, 7)
    assert not np.array_equal(a["masked_positions"], b["masked_positions"])


def test_whole_word_masking_takes_whole_words():
    seqs = pack(fake_docs([60] * 50, seed=2), 64)
    spec = masking_spec(whole_word=True, m=12)
    for s in seqs:
        out = text.seeded_mask(s, spec, 0)
        k = int(out["masked_weights"].sum())
        chosen = set(out["masked_positions"][:k].tolist())
        cand = np.flatnonzero(np.arange(64) < s["length"])
        cand = cand[s["input_ids"][cand] >= 10]
        for word in text.word_groups(cand, s["word_starts"]):
            hit = chosen & set(word.tolist())
            assert not hit or hit == set(word.tolist())
        assert 0 < k <= min(12, round(0.15 * len(cand)))


@pytest.fixture(scope="module")
def wikitext_cfg(shared_data):
    cfg = text.default_mlm_data_config()
    cfg.text_files = {"valid": str(shared_data / "wikitext-2" / "valid.txt")}
    cfg.train_split, cfg.test_split = "valid[:300]", "valid[-60:]"
    cfg.tokenizer = str(shared_data / "bert-base-uncased-vocab" / "vocab.txt")
    cfg.unk_marker = "<unk>"
    cfg.max_seq_length = 64
    return cfg


def test_wikitext_train_batches_and_resume(wikitext_cfg):
    p = text.make_mlm_pipeline(wikitext_cfg, split="train", batch_size=4, seed=3, train=True,
                               shard_index=1, shard_count=2)
    batch = next(p.iterator)
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        "input_ids": ((4, 64), "int32"), "attention_mask": ((4, 64), "int32"),
        "token_type_ids": ((4, 64), "int32"), "masked_positions": ((4, 12), "int32"),
        "masked_ids": ((4, 12), "int32"), "masked_weights": ((4, 12), "float32"),
        "mask": ((4,), "bool")}
    tok = p.tokenizer
    unk_pieces = [tok._backend.token_to_id(t) for t in ("<", "un", "##k", ">")]
    states, batches = [], []
    for _ in range(40):                       # 40 global batches of 8: past one epoch
        states.append(json.loads(json.dumps(p.iterator.get_state())))   # as a checkpoint would
        batches.append(next(p.iterator))
    seen_unk = False
    for b in batches:
        ids = b["input_ids"][b["attention_mask"] == 1]
        seen_unk |= bool((b["masked_ids"] == tok.special.unk).any()
                         or (ids == tok.special.unk).any())
        windows = np.lib.stride_tricks.sliding_window_view(b["input_ids"], 4, axis=1)
        assert not (windows == unk_pieces).all(-1).any()
    assert seen_unk
    assert any(s["offset"] > 0 for s in states)           # some state sits inside a document
    for i in (5, 17, 33):
        fresh = text.make_mlm_pipeline(wikitext_cfg, split="train", batch_size=4, seed=3,
                                       train=True, shard_index=1, shard_count=2)
        fresh.iterator.set_state(states[i])
        for j in range(i, min(i + 4, 40)):
            b = next(fresh.iterator)
            assert all(np.array_equal(b[k], batches[j][k]) for k in b), (i, j)


def test_wikitext_global_batches_do_not_depend_on_the_shard_count(wikitext_cfg):
    """Shards 0 and 1 of 2 (4 rows each) concatenate to the 1-shard batch of 8, bit for bit
    (tokens and masks), across the first epoch boundary."""
    tokenizer = text.load_tokenizer(wikitext_cfg.tokenizer, lowercase=True)
    assert list(text.open_documents(wikitext_cfg, "valid[10:300:7]")) == \
        list(text.open_documents(wikitext_cfg, "valid"))[10:300:7]
    per_epoch = len(text.pack_documents(text.open_documents(wikitext_cfg, "valid[:300]"),
                                        tokenizer, text.pack_spec(wikitext_cfg, tokenizer),
                                        wikitext_cfg.unk_marker))
    steps = per_epoch // 8 + 2

    def batches(batch_size, shard_index, shard_count):
        p = text.make_mlm_pipeline(wikitext_cfg, split="train", batch_size=batch_size, seed=5,
                                   train=True, shard_index=shard_index,
                                   shard_count=shard_count, tokenizer=tokenizer)
        return [next(p.iterator) for _ in range(steps)]

    whole = batches(8, 0, 1)
    halves = [batches(4, i, 2) for i in range(2)]
    for w, a, b in zip(whole, *halves):
        for k in w:
            np.testing.assert_array_equal(w[k], np.concatenate([a[k], b[k]]))


def test_wikitext_eval_shards_cover_the_split(wikitext_cfg):
    one = text.make_mlm_pipeline(wikitext_cfg, split="test", batch_size=4, seed=0, train=False)
    full = [b for b in one.iterator]
    real = np.concatenate([b["input_ids"][b["mask"]] for b in full])
    assert len(real) == one.num_examples
    shards = [text.make_mlm_pipeline(wikitext_cfg, split="test", batch_size=4, seed=0,
                                     train=False, shard_index=i, shard_count=3) for i in range(3)]
    got = [list(s.iterator) for s in shards]
    assert len({len(g) for g in got}) == 1 and len(got[0]) == shards[0].num_batches
    rows = np.concatenate([b["input_ids"][b["mask"]] for g in got for b in g])
    assert sorted(map(bytes, rows)) == sorted(map(bytes, real))   # same sequences, same masks


def test_bad_config(wikitext_cfg, tmp_path):
    cfg = wikitext_cfg.copy_and_resolve_references()
    cfg.mask_rate, cfg.source, cfg.train_split = 1.5, "hdfs", "nosuch"
    with pytest.raises(ValueError) as e:
        text.validate_mlm_data_config(cfg)
    for field in ("data.mask_rate=1.5", "data.source='hdfs'"):
        assert field in str(e.value)
    cfg = wikitext_cfg.copy_and_resolve_references()
    cfg.train_split = "nosuch"
    with pytest.raises(ValueError, match="split 'nosuch' is not a key of data.text_files"):
        text.validate_mlm_data_config(cfg)
    cfg = wikitext_cfg.copy_and_resolve_references()
    cfg.text_files = {"valid": str(tmp_path / "missing*.txt")}
    cfg.train_split = cfg.test_split = "valid"
    with pytest.raises(ValueError, match="matches no file") as e:
        text.make_mlm_pipeline(cfg, split="train", batch_size=2, seed=0, train=True)
    assert str(e.value).count("matches no file") == 1     # one file, named once
    # A bad byte is found when the files are opened (for their document spans), not when its
    # document is first drawn, maybe hours into training; and it is named by line.
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("ok\n\ncaf\xe9 ok\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{bad}: line 3, bytes 7..8 are not valid UTF-8; "
                                         r"convert the file to UTF-8$"):
        text.TextFileSource([str(bad)])
    bad.write_bytes(b"ok\n\ncafe ok\n")
    source = text.TextFileSource([str(bad)])
    bad.write_bytes("ok\n\ncaf\xe9 ok\n".encode("latin-1"))   # changed since it was opened
    with pytest.raises(ValueError, match=rf"^{bad}: bytes 7..8 are not valid UTF-8"):
        source[1]


def test_config_checks_keys_and_that_tfds_opens_both_splits(wikitext_cfg, tmp_path):
    cfg = wikitext_cfg.copy_and_resolve_references()
    cfg.mask_rat = 0.2
    with pytest.raises(ValueError, match=r"unknown key\(s\) data.mask_rat: .*valid keys "
                                         r"are .*mask_rate"):
        text.validate_mlm_data_config(cfg)
    cfg = wikitext_cfg.copy_and_resolve_references()
    cfg.update(source="tfds", tfds_name="wikipedia/20230601.en", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"(?s)data.train_split=.*could not be opened") as e:
        text.validate_mlm_data_config(cfg)
    # TFDS's error goes on to list every dataset it knows (the message had 263 lines).
    assert "Available datasets" not in str(e.value) and len(str(e.value)) < 1500, str(e.value)


def test_tfds_corpus(wikitext_cfg):
    """A TFDS text dataset by name (mocked wikipedia, array_record via tfds.data_source)."""
    tfds = pytest.importorskip("tensorflow_datasets")
    import tensorflow_datasets.text.wikipedia  # noqa: F401  (registers the builder for mocking)

    cfg = wikitext_cfg.copy_and_resolve_references()
    cfg.update(source="tfds", tfds_name="wikipedia/20230601.en", train_split="train",
               test_split="train", text_key="text", unk_marker="")
    with tfds.testing.mock_data(num_examples=24):
        train = text.make_mlm_pipeline(cfg, split="train", batch_size=4, seed=0, train=True)
        batch = next(train.iterator)
        assert batch["input_ids"].shape == (4, 64) and batch["masked_weights"].sum() > 0
        evaluation = text.make_mlm_pipeline(cfg, split="test", batch_size=4, seed=0,
                                            train=False)
        # 24 short documents pack into a few sequences, each ending with [SEP]
        assert 0 < evaluation.num_examples < 24
        batches = list(evaluation.iterator)
        assert len(batches) == evaluation.num_batches
        seps = sum(int(((b["input_ids"] == 102) & b["mask"][:, None]).sum()) for b in batches)
        assert seps == 24
        # a step: TFDS reads the split, posjax takes every 5th (mock data differ per open)
        assert len(text.open_documents(cfg, "train[::5]")) == len(range(0, 24, 5))
        cfg.text_key = "body"
        with pytest.raises(ValueError, match="data.text_key='body' is not a feature"):
            text.make_mlm_pipeline(cfg, split="train", batch_size=4, seed=0, train=True)
    cfg.update(tfds_name="wikipedia/20230601.en", data_dir="/nonexistent", text_key="text")
    with pytest.raises(ValueError, match="(?s)could not be opened.*tfds build"):
        text.make_mlm_pipeline(cfg, split="train", batch_size=4, seed=0, train=True)


def test_glue_global_batches_do_not_depend_on_the_shard_count(shared_data):
    """GLUE training (posjax.data.glue): shards 0 and 1 of 2 (4 rows each) concatenate to the
    1-shard batch of 8, across an epoch boundary of a 40-example split."""
    from posjax.data import glue

    cfg = glue.default_glue_data_config("mrpc")
    cfg.glue_dir = str(shared_data / "glue")
    cfg.tokenizer = str(shared_data / "bert-base-uncased-vocab" / "vocab.txt")
    cfg.update(train_split="train[:40]", max_seq_length=32)

    def batches(batch_size, shard_index, shard_count):
        p = glue.make_glue_pipeline(cfg, split="train", batch_size=batch_size, seed=1,
                                    train=True, shard_index=shard_index,
                                    shard_count=shard_count)
        return [next(p.iterator) for _ in range(7)]   # 56 rows > 40 examples

    whole = batches(8, 0, 1)
    halves = [batches(4, i, 2) for i in range(2)]
    for w, a, b in zip(whole, *halves):
        for k in w:
            np.testing.assert_array_equal(w[k], np.concatenate([a[k], b[k]]))
