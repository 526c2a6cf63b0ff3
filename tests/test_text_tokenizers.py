"""Tokenizers: BERT vocab.txt parity with transformers, training CLI for each kind, special ids."""
import pathlib

import numpy as np
import pytest

from posjax.data import tokenizers as tk

CORPUS = """The quick brown fox jumps over the lazy dog.
A stitch in time saves nine; the early bird catches the worm.
Colourless green ideas sleep furiously, said the linguist.

Homarus gammarus, known as the European lobster, lives in the Atlantic Ocean.
It may grow to a length of 60 cm and a mass of 6 kilograms.
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(CORPUS * 20, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bert_vocab(shared_data) -> pathlib.Path:
    return shared_data / "bert-base-uncased-vocab" / "vocab.txt"


def test_bert_vocab_matches_transformers(bert_vocab, shared_data):
    transformers = pytest.importorskip("transformers")
    ours = tk.load_tokenizer(bert_vocab)
    assert ours.special == tk.SpecialIds(pad=0, unk=100, cls=101, sep=102, mask=103)
    assert ours.vocab_size == 30522
    reference = transformers.BertTokenizer(str(bert_vocab), do_lower_case=True)
    lines = (shared_data / "wikitext-2" / "valid.txt").read_text(encoding="utf-8").splitlines()
    texts = [t for t in lines if t.strip()][:150] + [
        "Héllo WORLD, [MASK] it's naïve café — 3.5% (x)!", "[UNK] [CLS] a [SEP] b"]
    for text, enc in zip(texts, ours.encode_batch(texts)):
        expected = reference.encode(text, add_special_tokens=False)
        assert enc.ids.tolist() == expected, text
        pieces = reference.convert_ids_to_tokens(expected)
        assert enc.word_starts.tolist() == [not p.startswith("##") for p in pieces], text


@pytest.mark.parametrize("kind", tk.KINDS)
def test_train_cli_then_load(kind, corpus, tmp_path, capsys):
    out = tmp_path / kind
    vocab_size = 80 if kind == "unigram" else 320     # SentencePiece caps it by the corpus
    assert tk.main(["train", str(corpus), "--kind", kind, "--vocab_size", str(vocab_size),
                    "--output", str(out), "--min_frequency", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    tok = tk.load_tokenizer(out)                       # the folder is enough
    if kind == "unigram":
        assert tok.special == tk.SpecialIds(pad=0, unk=3, cls=1, sep=2, mask=4)
    else:
        assert tok.special == tk.SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4)
    assert tok.vocab_size <= vocab_size
    text = "the lazy fox lives in the ocean"
    enc = tok.encode(text)
    assert enc.ids.dtype == np.int32 and len(enc.ids) == len(enc.word_starts) > 0
    assert not set(enc.ids.tolist()) & tok.special_ids
    assert int(enc.word_starts.sum()) == len(text.split())      # one start per word
    assert tok.decode(enc.ids).strip().lower() == text
    assert tok.encode("the [MASK] fox").ids.tolist().count(tok.special.mask) == 1
    # The CLI never overwrites an existing tokenizer.
    assert tk.main(["train", str(corpus), "--kind", kind, "--vocab_size", "320",
                    "--output", str(out)]) == 2
    assert "never overwritten" in capsys.readouterr().err


def test_missing_specials_are_appended(corpus, tmp_path):
    """A GPT-2 style tokenizer.json (no [CLS]/[MASK]/...) and an spm.model without [MASK] get
    the missing specials after their vocabulary (DeBERTa-v3 puts [MASK] at len(spm))."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import sentencepiece as spm

    gpt = Tokenizer(models.BPE())
    gpt.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt.decoder = decoders.ByteLevel()
    gpt.train([str(corpus)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    gpt.save(str(tmp_path / "tokenizer.json"))
    tok = tk.load_tokenizer(tmp_path / "tokenizer.json")
    base = gpt.get_vocab_size()
    assert tok.special.as_tuple() == tuple(range(base, base + 5))
    assert tok.vocab_size == base + 5
    assert tok.encode("a [MASK] b").ids.tolist().count(tok.special.mask) == 1

    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "plain"),
                                   vocab_size=60, pad_id=0, pad_piece="[PAD]", bos_id=1,
                                   bos_piece="[CLS]", eos_id=2, eos_piece="[SEP]", unk_id=3,
                                   unk_piece="[UNK]", minloglevel=2, num_threads=1)
    tok = tk.load_tokenizer(tmp_path / "plain.model")
    assert tok.special == tk.SpecialIds(pad=0, unk=3, cls=1, sep=2, mask=60)
    assert tok.vocab_size == 61 and tok.id_to_token(60) == "[MASK]"


def test_saved_truncation_and_padding_are_switched_off(corpus, tmp_path, caplog):
    """A tokenizer.json saved with truncation and padding on (as after a truncating HF call)
    must not cut documents or put pad ids among the tokens: the pipelines do both."""
    from tokenizers import Tokenizer
    tk.train_tokenizer([str(corpus)], tmp_path / "tok", "wordpiece", 200)
    saved = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    full, fox = (saved.encode(t, add_special_tokens=False).ids for t in (CORPUS, "fox"))
    saved.enable_truncation(max_length=16)
    saved.enable_padding(length=16, pad_id=0, pad_token="[PAD]")
    saved.save(str(tmp_path / "cut.json"))
    with caplog.at_level("WARNING"):
        tok = tk.load_tokenizer(tmp_path / "cut.json")
    assert "switched off the truncation" in caplog.text and "and the padding" in caplog.text
    assert len(full) > 16 and len(fox) < 16
    assert [e.ids.tolist() for e in tok.encode_batch([CORPUS, "fox"])] == [full, fox]


def test_bad_inputs(tmp_path, corpus, capsys):
    with pytest.raises(ValueError, match="does not exist"):
        tk.load_tokenizer(tmp_path / "nope.txt")
    (tmp_path / "vocab.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="unknown suffix"):
        tk.load_tokenizer(tmp_path / "vocab.bin")
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match="no unknown token"):
        tk.load_tokenizer(tmp_path / "v")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="holds none of"):
        tk.load_tokenizer(tmp_path / "empty_dir")
    with pytest.raises(ValueError, match="vocab_size=10 is too small"):
        tk.train_tokenizer([corpus], tmp_path / "o", "bpe", 10)
    with pytest.raises(ValueError, match="SentencePiece training failed.*<= "):
        tk.train_tokenizer([corpus], tmp_path / "o2", "unigram", 5000)
    with pytest.raises(ValueError, match="kind='sentencepiece'"):
        tk.train_tokenizer([corpus], tmp_path / "o", "sentencepiece", 1000)
    assert tk.main(["train", str(tmp_path / "missing.txt"), "--output", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


SPECIALS = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n"


def test_bert_vocab_is_read_as_the_library_reads_it(bert_vocab):
    """Our vocab.txt reader gives tokenizers' own {token: id} for BERT's vocabulary (which
    therefore repeats no token)."""
    from tokenizers import models

    assert tk.read_wordpiece_vocab(str(bert_vocab)) == models.WordPiece.read_file(str(bert_vocab))


def test_vocab_lines_end_as_the_library_ends_them(tmp_path):
    """Trailing Unicode white space is dropped (U+3000 too) but not the controls U+001C..U+001F
    that Python's rstrip() would drop; blank lines after the last token are no tokens (two of
    them were refused as a repeated '' token)."""
    from tokenizers import models

    lines = SPECIALS + "x\x1c\ny \u3000\r\nz\n"
    (tmp_path / "lines.txt").write_text(lines, encoding="utf-8")
    (tmp_path / "blank.txt").write_text(lines + "\n\n", encoding="utf-8")
    ours = tk.read_wordpiece_vocab(str(tmp_path / "lines.txt"))
    assert ours == models.WordPiece.read_file(str(tmp_path / "lines.txt"))
    assert ours["x\x1c"] == 5 and ours["y"] == 6
    assert tk.read_wordpiece_vocab(str(tmp_path / "blank.txt")) == ours
    assert tk.load_tokenizer(tmp_path / "blank.txt").vocab_size == 8


def test_vocab_with_a_repeated_token_is_refused(tmp_path):
    """The library keeps the last id of a repeated token and counts distinct tokens, so ids
    would reach past vocab_size (NaN embeddings); the file is refused instead."""
    vocab = tmp_path / "repeated.txt"
    vocab.write_text(SPECIALS + "the\ncat\nthe\ndog\ncat\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"repeated.txt has 2 line\(s\) repeating an earlier "
                                         r"token, the first 'the' on lines 6 and 8: list each "
                                         r"token once"):
        tk.load_tokenizer(vocab)


def test_vocab_bom_is_not_part_of_the_first_token(tmp_path):
    vocab = tmp_path / "bom.txt"
    vocab.write_text("\ufeff" + SPECIALS + "cat\n", encoding="utf-8")
    tok = tk.load_tokenizer(vocab)
    assert tok.special == tk.SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4)
    assert tok.vocab_size == 6 and tok.encode("cat").ids.tolist() == [5]


def test_vocab_that_is_not_utf8_is_refused_with_its_line(tmp_path):
    vocab = tmp_path / "latin1.txt"
    vocab.write_bytes(SPECIALS.encode() + b"cat\ncaf\xe9\n")
    with pytest.raises(ValueError, match=r"latin1.txt: line 7, bytes 38..39 are not valid UTF-8; "
                                         r"convert the file to UTF-8"):
        tk.load_tokenizer(vocab)
