"""Tokenizers for the text models: load a published vocabulary or train a new one.

``load_tokenizer(path)`` accepts

- a BERT WordPiece ``vocab.txt`` (UTF-8, an optional BOM; one token per line, id = line
  number, so a repeated token is refused), run with BERT's normalisation (optional
  lower-casing and accent stripping) and punctuation splitting;
- a SentencePiece ``*.model`` (e.g. DeBERTa-v3 ``spm.model``);
- a Hugging Face ``tokenizer.json`` (GPT-2 byte-level BPE, DeBERTa v1, or one trained here);
  truncation or padding saved in it is switched off, with a warning (the pipelines cut and
  pad to ``max_seq_length`` themselves; the file's would cut documents and put pad ids among
  the real tokens);
- a folder holding one of these (looked up in the order above);
- ``bytes``: the built-in byte-level vocabulary (no file): [PAD] [UNK] [CLS] [SEP] [MASK] take
  ids 0..4 and byte ``b`` of the UTF-8 text is token ``5 + b`` (261 ids; ASCII text is one
  token per character). Character-level MLM without a vocabulary to train or ship.

Every tokenizer exposes the five special ids the models need (``pad``, ``unk``, ``cls``,
``sep``, ``mask``). Each is found under its BERT name (``[PAD]`` ...) or its RoBERTa/GPT name
(``<pad>`` ...); a special token the vocabulary lacks is appended after it, in the order
pad, unk, cls, sep, mask, as DeBERTa-v3 does for ``[MASK]`` (id 128000 after a 128000-piece
``spm.model``). ``vocab_size`` counts the appended tokens.

``encode(text)`` returns the ids WITHOUT special tokens, plus a boolean ``word_starts`` per
token (True where a new word begins), which whole-word masking uses: for WordPiece and BPE the
words are the pre-tokenizer's pieces (a WordPiece ``##`` continuation or a BPE sub-word
continues a word), for SentencePiece a new word starts at a piece beginning with ``▁``.

Train from the command line (writes into an empty or new folder; never overwrites)::

    python -m posjax.data.tokenizers train --kind wordpiece --vocab_size 8000 \
        --output runs/tok corpus1.txt corpus2.txt
    python -m posjax.data.tokenizers encode runs/tok "Some text to inspect."

``--kind``: ``wordpiece`` (vocab.txt + tokenizer.json), ``bpe`` (byte-level BPE,
tokenizer.json), ``unigram`` (SentencePiece, spm.model with [PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3
[MASK]=4, the DeBERTa-v3 layout plus [MASK]).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import logging
import pathlib
import sys
from typing import Any, Sequence

import numpy as np

from posjax.data.common import line_at, not_utf8_error

SPECIAL_NAMES: dict[str, tuple[str, ...]] = {
    "pad": ("[PAD]", "<pad>"),
    "unk": ("[UNK]", "<unk>"),
    "cls": ("[CLS]", "<s>"),
    "sep": ("[SEP]", "</s>"),
    "mask": ("[MASK]", "<mask>"),
}
SPM_WORD_START = "\u2581"  # '▁'
KINDS = ("wordpiece", "bpe", "unigram")


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    pad: int
    unk: int
    cls: int
    sep: int
    mask: int

    def as_tuple(self) -> tuple[int, ...]:
        return (self.pad, self.unk, self.cls, self.sep, self.mask)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """Token ids (T,) int32 and word starts (T,) bool of one text, no special tokens."""

    ids: np.ndarray
    word_starts: np.ndarray


class TextTokenizer:
    """One interface over a Hugging Face ``tokenizers.Tokenizer`` or a SentencePiece model.

    ``appended`` names the special tokens added after a SentencePiece vocabulary (a Hugging
    Face tokenizer holds its added tokens itself).
    """

    def __init__(self, backend, path: str, appended: Sequence[str] = ()):
        self._backend = backend
        self.path = path
        self.appended = tuple(appended)
        self.vocab_size = self._base_size() + len(self.appended)
        self.special = SpecialIds(**{role: self._special_id(names)
                                     for role, names in SPECIAL_NAMES.items()})

    @property
    def is_sentencepiece(self) -> bool:
        return not hasattr(self._backend, "encode_batch")

    def _base_size(self) -> int:
        if self.is_sentencepiece:
            return self._backend.get_piece_size()
        return self._backend.get_vocab_size(with_added_tokens=True)

    def _special_id(self, names: tuple[str, ...]) -> int:
        for name in names:
            if name in self.appended:
                return self._base_size() + self.appended.index(name)
            found = _lookup(self._backend, name)
            if found is not None:
                return found
        raise ValueError(f"tokenizer {self.path!r} has none of the tokens {names}")

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.special.as_tuple())

    def encode(self, text: str) -> Encoded:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[Encoded]:
        """Encode several texts (no special tokens added)."""
        if self.is_sentencepiece:
            out = []
            for ids in self._backend.encode(list(texts), out_type=int):
                starts = [self._backend.id_to_piece(i).startswith(SPM_WORD_START) for i in ids]
                if starts:
                    starts[0] = True
                out.append(Encoded(np.asarray(ids, np.int32), np.asarray(starts, bool)))
            return out
        out = []
        for enc in self._backend.encode_batch(list(texts), add_special_tokens=False):
            words = enc.word_ids
            starts = [i == 0 or w is None or w != words[i - 1] for i, w in enumerate(words)]
            out.append(Encoded(np.asarray(enc.ids, np.int32), np.asarray(starts, bool)))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.is_sentencepiece:
            return self._backend.decode([i for i in ids if i < self._base_size()])
        return self._backend.decode(ids, skip_special_tokens=False)

    def id_to_token(self, i: int) -> str:
        if self.is_sentencepiece:
            base = self._base_size()
            return self.appended[i - base] if i >= base else self._backend.id_to_piece(i)
        return self._backend.id_to_token(i)

    def vocabulary_identity(self, block: int = 1024) -> dict[str, Any]:
        """What the ids stand for, whatever file format holds the vocabulary: ``sha256`` (hex)
        of every token id by id and the special-token ids, equal exactly when every id is the
        same token; ``size``; and ``blocks``, a short digest of each run of ``block`` ids, to
        tell an edited vocabulary (a few blocks differ) from another one (most do)."""
        whole = hashlib.sha256(repr(self.special.as_tuple()).encode())
        blocks = []
        for start in range(0, self.vocab_size, block):
            part = hashlib.sha256()
            for i in range(start, min(start + block, self.vocab_size)):
                token = self.id_to_token(i)   # None: an id the vocabulary leaves unassigned
                data = ("\0" if token is None else token).encode("utf-8", "surrogatepass") + b"\0"
                whole.update(data)
                part.update(data)
            blocks.append(part.hexdigest()[:16])
        return {"sha256": whole.hexdigest(), "size": self.vocab_size, "block": block,
                "blocks": blocks}

    def __repr__(self) -> str:
        kind = "sentencepiece" if self.is_sentencepiece else "tokenizers"
        return (f"TextTokenizer({self.path!r}, {kind}, vocab_size={self.vocab_size}, "
                f"special={self.special})")


# ----------------------------------------------------------------------------- loading


def _lookup(backend, token: str) -> int | None:
    """The id of ``token`` in a tokenizers/SentencePiece backend, None when absent."""
    if hasattr(backend, "token_to_id"):
        return backend.token_to_id(token)
    i = backend.piece_to_id(token)
    return i if backend.id_to_piece(i) == token else None


def _missing_specials(backend) -> list[str]:
    return [names[0] for names in SPECIAL_NAMES.values()
            if all(_lookup(backend, n) is None for n in names)]


def _from_hf(tokenizer, path: str) -> TextTokenizer:
    """Register the special tokens (so they match in raw text), appending the missing ones."""
    from tokenizers import AddedToken

    specials = [n for names in SPECIAL_NAMES.values() for n in names
                if tokenizer.token_to_id(n) is not None] + _missing_specials(tokenizer)
    tokenizer.add_special_tokens([AddedToken(n, special=True, normalized=False)
                                  for n in specials])
    return TextTokenizer(tokenizer, path)


# What the tokenizers library (Rust's char::is_whitespace) strips from the end of a vocab line:
# Unicode White_Space. Python's str.rstrip() would also strip U+001C..U+001F.
_WHITE_SPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B)))
                + "\u2028\u2029\u202f\u205f\u3000")


def read_wordpiece_vocab(vocab_file: str) -> dict[str, int]:
    """``{token: id}`` of a WordPiece ``vocab.txt``, parsed as the tokenizers library does (id =
    line number, trailing white space dropped), after checks it lacks: the file must be UTF-8
    (a leading BOM is skipped) and hold each token once (a repeated token leaves its first id
    unused, so ids would reach past the vocabulary size the library reports). Blank lines
    after the last token are not tokens."""
    data = pathlib.Path(vocab_file).read_bytes()
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise not_utf8_error(vocab_file, e, line=line_at(data, e.start)) from e
    tokens = [line.rstrip(_WHITE_SPACE) for line in text.split("\n")]
    while tokens and not tokens[-1]:   # the final newline, blank lines after the last token
        tokens.pop()
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) < len(tokens):
        raise ValueError(_duplicates_message(vocab_file, tokens))
    return vocab


def _duplicates_message(vocab_file: str, tokens: Sequence[str]) -> str:
    first_line: dict[str, int] = {}
    repeats = []  # (token, line of its first occurrence, line of the repeat)
    for line, token in enumerate(tokens, 1):
        if token in first_line:
            repeats.append((token, first_line[token], line))
        first_line.setdefault(token, line)
    token, first, again = repeats[0]
    return (f"WordPiece vocabulary {vocab_file} has {len(repeats)} line(s) repeating an earlier "
            f"token, the first {token!r} on lines {first} and {again}: list each token once, "
            "one per line (a token's id is its line number)")


def wordpiece_tokenizer(vocab_file: str | None = None, lowercase: bool = True):
    """A ``tokenizers.Tokenizer`` running BERT's normaliser, punctuation split and WordPiece
    over ``vocab_file`` (None: an empty model to train)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = read_wordpiece_vocab(vocab_file) if vocab_file else None
    unk = "[UNK]"
    if vocab is not None:
        unk = next((n for n in SPECIAL_NAMES["unk"] if n in vocab), None)
        if unk is None:
            raise ValueError(f"WordPiece vocabulary {vocab_file} has no unknown token "
                             f"({' or '.join(SPECIAL_NAMES['unk'])}): add a line '[UNK]'")
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100)
                          if vocab is not None else
                          models.WordPiece(unk_token=unk, max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                      strip_accents=lowercase,
                                                      lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def _resolve(path: pathlib.Path) -> pathlib.Path:
    if path.is_dir():
        for name in ("vocab.txt", "spm.model", "tokenizer.json"):
            if (path / name).is_file():
                return path / name
        models = sorted(path.glob("*.model"))
        if models:
            return models[0]
        raise ValueError(f"tokenizer folder {str(path)!r} holds none of vocab.txt, spm.model, "
                         "*.model, tokenizer.json: point data.tokenizer at one of these files")
    if not path.is_file():
        raise ValueError(f"tokenizer {str(path)!r} does not exist: give a vocab.txt, a "
                         "SentencePiece .model, a tokenizer.json or a folder holding one")
    return path


def load_tokenizer(path: str | pathlib.Path, lowercase: bool = True) -> TextTokenizer:
    """The tokenizer at ``path`` (file or folder; see the module docstring).

    ``lowercase`` applies to WordPiece vocabularies only (BERT uncased: True, cased: False);
    SentencePiece models and tokenizer.json files carry their own normalisation.
    """
    if str(path) == BYTES:
        return byte_tokenizer()
    file = _resolve(pathlib.Path(path).expanduser())
    name = str(file)
    if file.suffix == ".json":
        from tokenizers import Tokenizer
        try:
            tokenizer = Tokenizer.from_file(name)
        except Exception as e:  # the library raises a bare Exception on parse errors
            raise ValueError(f"tokenizer {name!r} is not a valid tokenizer.json: {e}") from e
        saved = [f"{what} {settings}" for what, settings in
                 (("truncation", tokenizer.truncation), ("padding", tokenizer.padding))
                 if settings is not None]
        if saved:
            logging.warning("tokenizer %s: switched off the %s saved in it (the pipelines "
                            "truncate and pad to max_seq_length themselves)", name,
                            " and the ".join(saved))
            tokenizer.no_truncation()
            tokenizer.no_padding()
        return _from_hf(tokenizer, name)
    if file.suffix == ".model":
        import sentencepiece as spm
        processor = spm.SentencePieceProcessor()
        try:
            processor.load(name)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"tokenizer {name!r} is not a SentencePiece model: {e}") from e
        return TextTokenizer(processor, name, appended=_missing_specials(processor))
    if file.suffix == ".txt":
        return _from_hf(wordpiece_tokenizer(name, lowercase), name)
    raise ValueError(f"tokenizer {name!r} has an unknown suffix {file.suffix!r}: expected "
                     "vocab .txt (WordPiece), .model (SentencePiece) or .json (tokenizers)")


BYTES = "bytes"   # data.tokenizer value of the built-in byte-level vocabulary


def _byte_symbols() -> list[str]:
    """The printable stand-in of each byte 0..255 that the tokenizers library's ByteLevel
    pre-tokenizer maps it to (printable Latin-1 bytes stand for themselves, the other 68 take
    code points 256, 257, ... in byte order)."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


@functools.lru_cache(maxsize=1)
def _byte_backend():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {name: i for i, name in enumerate(BERT_SPECIALS)}
    vocab.update({symbol: len(BERT_SPECIALS) + b for b, symbol in enumerate(_byte_symbols())})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        pre_tokenizers.Split(Regex("."), "isolated")])   # every byte its own token
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def byte_tokenizer() -> TextTokenizer:
    """``load_tokenizer('bytes')``: UTF-8 byte ``b`` -> id ``5 + b``, specials 0..4."""
    return TextTokenizer(_byte_backend(), BYTES)


# ----------------------------------------------------------------------------- training

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_tokenizer(files: Sequence[str], output: str | pathlib.Path, kind: str,
                    vocab_size: int, lowercase: bool = True, min_frequency: int = 2
                    ) -> pathlib.Path:
    """Train a ``kind`` tokenizer on ``files`` and write it into ``output``; returns the file
    ``load_tokenizer`` should be given. Special tokens take ids 0..4 (see module docstring)."""
    _check_training_args(files, output, kind, vocab_size)
    out = pathlib.Path(output)
    out.mkdir(parents=True, exist_ok=True)
    files = [str(f) for f in files]
    if kind == "unigram":
        import sentencepiece as spm
        try:
            spm.SentencePieceTrainer.train(
                input=",".join(files), model_prefix=str(out / "spm"), vocab_size=vocab_size,
                model_type="unigram", pad_id=0, pad_piece="[PAD]", bos_id=1, bos_piece="[CLS]",
                eos_id=2, eos_piece="[SEP]", unk_id=3, unk_piece="[UNK]",
                user_defined_symbols=["[MASK]"], character_coverage=0.9995,
                normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
                minloglevel=2, num_threads=1)
        except RuntimeError as e:  # e.g. "Vocabulary size too high (N). Please set it to <= M"
            raise ValueError(f"SentencePiece training failed for vocab_size={vocab_size}: "
                             f"{str(e).split('] ')[-1]}") from e
        return out / "spm.model"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if kind == "wordpiece":
        tokenizer = wordpiece_tokenizer(None, lowercase)
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            show_progress=False,
                                            special_tokens=BERT_SPECIALS,
                                            continuing_subword_prefix="##")
        tokenizer.train(files, trainer)
        (out / "vocab.txt").write_text(
            "".join(t + "\n" for t, _ in sorted(tokenizer.get_vocab().items(),
                                               key=lambda kv: kv[1])), encoding="utf-8")
        tokenizer.save(str(out / "tokenizer.json"))
        return out / "vocab.txt"
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  show_progress=False,
                                  special_tokens=BERT_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train(files, trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def _check_training_args(files: Sequence[str], output: str | pathlib.Path, kind: str,
                         vocab_size: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not valid: choose one of {', '.join(KINDS)}")
    if not files:
        raise ValueError("no training files given: pass one or more plain-text files")
    for f in files:
        p = pathlib.Path(f)
        if not p.is_file():
            raise ValueError(f"training file {str(f)!r} does not exist or is not a file")
        if p.stat().st_size == 0:
            raise ValueError(f"training file {str(f)!r} is empty: give files with text")
    floor = 300 if kind == "bpe" else len(BERT_SPECIALS) + 1
    if vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size} is too small for kind={kind!r}: use at "
                         f"least {floor}" + (" (256 byte symbols + specials)" if kind == "bpe"
                                             else ""))
    out = pathlib.Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output {str(out)!r} exists and is not an empty folder: choose a new "
                         "folder (existing tokenizers are never overwritten)")


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posjax.data.tokenizers",
                                     description="Train or inspect posjax tokenizers.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a tokenizer on plain-text files")
    train.add_argument("files", nargs="+", help="plain-text training files")
    train.add_argument("--kind", choices=KINDS, default="wordpiece")
    train.add_argument("--vocab_size", type=int, default=30522)
    train.add_argument("--output", required=True, help="new or empty output folder")
    train.add_argument("--cased", action="store_true", help="keep case (default: lower-case)")
    train.add_argument("--min_frequency", type=int, default=2)
    enc = sub.add_parser("encode", help="show how a tokenizer splits a text")
    enc.add_argument("tokenizer", help="vocab.txt, *.model, tokenizer.json or a folder")
    enc.add_argument("text")
    enc.add_argument("--cased", action="store_true", help="WordPiece only: keep case")
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            path = train_tokenizer(args.files, args.output, args.kind, args.vocab_size,
                                   lowercase=not args.cased, min_frequency=args.min_frequency)
            tok = load_tokenizer(path, lowercase=not args.cased)
            print(f"wrote {path}: vocab_size={tok.vocab_size}, special ids {tok.special}")
        else:
            tok = load_tokenizer(args.tokenizer, lowercase=not args.cased)
            e = tok.encode(args.text)
            print(tok)
            for i, s in zip(e.ids.tolist(), e.word_starts.tolist()):
                print(f"{i}\t{'' if s else '  '}{tok.id_to_token(i)}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
