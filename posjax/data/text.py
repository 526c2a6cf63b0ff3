"""Masked-LM input: corpus sources, document-respecting packing, dynamic BERT masking (Grain).

Configuration (``default_mlm_data_config()`` returns every key; ``validate_mlm_data_config``
checks them, that the files of both splits exist or that TFDS opens both splits, before
anything is compiled or written):

================= ===========================================================================
key               meaning
================= ===========================================================================
source            ``text_files`` (local plain text) or ``tfds`` (a TFDS catalog dataset
                  prepared as array_record, read by ``tfds.data_source``; no TensorFlow)
text_files        ``text_files`` only: {split name: comma-separated paths or globs}
doc_boundary      ``text_files`` only: ``blank_line`` (a document is a run of non-blank
                  lines; BERT's corpus convention) or ``line`` (every non-blank line is one)
tfds_name         ``tfds`` only: e.g. ``wikipedia/20230601.en``, ``c4/en``
data_dir          ``tfds`` only: TFDS data dir ('' = ``~/tensorflow_datasets``)
text_key          ``tfds`` only: the feature holding the document text (``text``)
train_split       documents for ``split='train'``: a split name with an optional slice,
                  ``valid[:95%]``, ``train``
test_split        documents for ``split='test'`` (evaluation)
tokenizer         vocab.txt / SentencePiece .model / tokenizer.json, or ``bytes`` (built in:
                  one token per UTF-8 byte; posjax.data.tokenizers)
lowercase         WordPiece vocab.txt only: lower-case and strip accents (BERT uncased)
unk_marker        a corpus' own unknown-word marker (WikiText: ``<unk>``) mapped to the
                  tokenizer's unknown id ('' = none)
max_seq_length    L, tokens per packed sequence including [CLS] and [SEP]
mask_rate         fraction of (non-special) tokens to predict (BERT: 0.15)
max_predictions   M, masked slots per sequence (0 = ceil(mask_rate·L) rounded up to a
                  multiple of 4: 20 for L=128, 80 for L=512, as BERT)
whole_word        mask whole words (all sub-word pieces of a chosen word)
mask_token_rate   of the chosen tokens, the fraction replaced by [MASK] (0.8)
random_token_rate of the chosen tokens, the fraction replaced by a random token (0.1);
                  the rest (0.1) keep the original token
================= ===========================================================================

Packing: each document is tokenised without special tokens; sequences are
``[CLS] d1 [SEP] d2 [SEP] ... [PAD]...``. A document that fits into an empty sequence
(len <= L-2) is never split: when it does not fit into the space left, the current sequence is
closed and it starts the next one. Only a document longer than L-2 is cut, into pieces of L-2
tokens (``[CLS] piece [SEP]``); its last piece may share a sequence with what follows.
``token_type_ids`` are all 0.

Masking (per sequence, numpy): the candidates are the non-special tokens; n = min(M,
max(1, round(mask_rate · #candidates))) are chosen uniformly without replacement (whole words:
words in random order, a word skipped when it would exceed n, as in BERT); each chosen token
becomes [MASK] with probability 0.8, a uniformly random non-special token with 0.1, else stays.
The RNG of sequence ``k`` is ``numpy.random.default_rng([seed, k])``, with ``k`` its index in
the global training stream, so the masks are a pure function of (seed, position in the stream): re-masking a sequence each epoch is "dynamic
masking", and a restored Grain iterator reproduces the same batches.

Batches: ``input_ids``, ``attention_mask``, ``token_type_ids`` int32 (b, L);
``masked_positions``, ``masked_ids`` int32 (b, M); ``masked_weights`` float32 (b, M)
(1 for a real prediction, 0 for padding slots, which point at position 0 with id 0);
``mask`` bool (b,) (False for evaluation padding).

Training: one GLOBAL stream, the same for any number of processes. The split's documents
are permuted per (seed, epoch) by Grain and packed in that order into sequences ``k = 0, 1,
...``; global batch t is sequences [t·B, (t+1)·B) (B = ``batch_size · shard_count``) and shard
``i`` of ``n`` keeps rows [i·b, (i+1)·b) of it (b = ``batch_size``) and masks only those.
Packing is sequential (where a sequence ends depends on every earlier document), so every
process tokenises and packs the whole global stream and drops (before masking) the other
processes' rows. The price: each process tokenises the documents of the whole global batch
(measured here ~150k tokens/s on one loaded CPU core, WikiText-2 with BERT's WordPiece: ~0.2 s
for a 256 x 128-token global batch, on every process, every step). In exchange batches do
not depend on the process count, and the state is one position in the document stream (which
document, the offset inside it, sequences emitted), checkpointable and equal on every process.

Evaluation packs the whole test split once in memory (the same on every process) and masks
sequence ``k`` with ``default_rng([EVAL_MASK_SEED, k])`` whatever the run's seed, so every run
(seed, scheme) is scored on the same masked tokens; then shard
``i`` takes sequences ``i, i+n, ...``, with the last batch padded (``mask=False``) so every
shard yields the same number of batches.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import math
import os
import pathlib
from typing import Any, Iterable, Sequence

import grain
import ml_collections
import numpy as np

from posjax import config_defaults
from posjax.data import sources
from posjax.data.common import (check_pipeline_call, eval_batches_per_shard, key_problems,
                                not_utf8_error, stack_examples, utf8_lines)
from posjax.data.tokenizers import BYTES, Encoded, TextTokenizer, load_tokenizer
from posjax.io_utils import error_summary

Example = dict[str, Any]
EVAL_MASK_SEED = 0   # held-out masks: the same for every run seed (module docstring)
SOURCES = ("text_files", "tfds")
DOC_BOUNDARIES = ("blank_line", "line")


# ----------------------------------------------------------------------------- config


def default_mlm_data_config() -> ml_collections.ConfigDict:
    """Every MLM data key with its default (``config_defaults.mlm_data_config``)."""
    return config_defaults.mlm_data_config()


def max_predictions(cfg: ml_collections.ConfigDict) -> int:
    """M: ``cfg.max_predictions`` or ceil(mask_rate · L) rounded up to a multiple of 4."""
    if cfg.max_predictions:
        return int(cfg.max_predictions)
    return 4 * math.ceil(math.ceil(cfg.mask_rate * cfg.max_seq_length) / 4)


def _problems(cfg: ml_collections.ConfigDict) -> list[str]:
    out = key_problems(cfg, default_mlm_data_config(),
                       "posjax.data.text.default_mlm_data_config()")
    if out:
        return out

    def check(ok: bool, field: str, fix: str) -> None:
        if not ok:
            out.append(f"data.{field}={cfg[field]!r}: {fix}")

    check(cfg.source in SOURCES, "source", f"choose one of {', '.join(SOURCES)}")
    check(cfg.doc_boundary in DOC_BOUNDARIES, "doc_boundary",
          f"choose one of {', '.join(DOC_BOUNDARIES)}")
    check(isinstance(cfg.max_seq_length, int) and cfg.max_seq_length >= 8, "max_seq_length",
          "must be an integer >= 8")
    check(0.0 < cfg.mask_rate < 1.0, "mask_rate", "must lie in (0, 1) (BERT: 0.15)")
    check(isinstance(cfg.max_predictions, int) and cfg.max_predictions >= 0,
          "max_predictions", "must be an integer >= 0 (0 = derived from mask_rate)")
    if not out and cfg.max_predictions:
        check(cfg.max_predictions >= round(cfg.mask_rate * cfg.max_seq_length),
              "max_predictions", f"must be >= round(mask_rate * max_seq_length) = "
              f"{round(cfg.mask_rate * cfg.max_seq_length)} or 0 (derived)")
    for field in ("mask_token_rate", "random_token_rate"):
        check(0.0 <= cfg[field] <= 1.0, field, "must lie in [0, 1]")
    check(cfg.mask_token_rate + cfg.random_token_rate <= 1.0, "random_token_rate",
          f"mask_token_rate + random_token_rate = "
          f"{cfg.mask_token_rate + cfg.random_token_rate} must be <= 1")
    for field in ("train_split", "test_split"):
        try:
            sources.parse_split(cfg[field])
        except (ValueError, AttributeError) as e:
            out.append(f"data.{field}={cfg[field]!r}: {e}")
    tok = pathlib.Path(str(cfg.tokenizer)).expanduser()
    check(cfg.tokenizer == BYTES or (bool(cfg.tokenizer) and tok.exists()), "tokenizer",
          "set it to a vocab.txt, SentencePiece .model or tokenizer.json (or train one with "
          f"python -m posjax.data.tokenizers train ...), or {BYTES!r} for one token per byte")
    if out:
        return out
    if cfg.source == "text_files":
        for field in ("train_split", "test_split"):
            base, _, _ = sources.parse_split(cfg[field])
            if base not in cfg.text_files:
                out.append(f"data.{field}={cfg[field]!r}: split {base!r} is not a key of "
                           f"data.text_files (has {sorted(cfg.text_files)})")
                continue
            try:
                expand_files(cfg.text_files[base])
            except ValueError as e:
                problem = f"data.text_files.{base}: {e}"
                if problem not in out:   # train and test may read the same file
                    out.append(problem)
    elif any(sources.is_complement(cfg[f]) for f in ("train_split", "test_split")):
        out.append("data.train_split/test_split: a complement ('~') is read from text_files "
                   "only; give TFDS a slice")
    elif not cfg.tfds_name:
        out.append("data.tfds_name='': set the TFDS dataset name, e.g. wikipedia/20230601.en")
    else:   # opening a split reads no records; the first failure is usually the dataset's
        for field in ("train_split", "test_split"):
            try:
                TfdsTextSource(cfg.tfds_name, sources.without_step(cfg[field]), cfg.data_dir,
                               cfg.text_key)
            except ValueError as e:
                out.append(f"data.{field}={cfg[field]!r}: {e}")
                break
    return out


def validate_mlm_data_config(cfg: ml_collections.ConfigDict) -> None:
    """Raises one ValueError listing every problem (field, value, fix)."""
    problems = _problems(cfg)
    if problems:
        raise ValueError("bad MLM data config:\n  " + "\n  ".join(problems))


# ----------------------------------------------------------------------------- sources


def expand_files(spec: str) -> list[str]:
    """Comma-separated paths or globs -> the sorted list of existing files (each glob sorted)."""
    files: list[str] = []
    for part in (p.strip() for p in str(spec).split(",")):
        if not part:
            continue
        found = sorted(glob.glob(os.path.expanduser(part)))
        if not found:
            raise ValueError(f"{part!r} matches no file: give existing text file paths or globs")
        files += [f for f in found if os.path.isfile(f)]
    if not files:
        raise ValueError(f"{spec!r} names no file: give comma-separated text file paths/globs")
    return files


def document_spans(lines: Iterable[bytes], boundary: str) -> np.ndarray:
    """Byte spans (D, 2) [start, end) of the documents in a file's lines (read as a stream).

    ``blank_line``: maximal runs of lines holding non-whitespace; ``line``: each such line.
    """
    spans = []
    start = None
    pos = 0
    for line in lines:
        end = pos + len(line)
        if line.strip():
            if boundary == "line":
                spans.append((pos, end))
            elif start is None:
                start = pos
        elif start is not None:
            spans.append((start, pos))
            start = None
        pos = end
    if start is not None:
        spans.append((start, pos))
    return np.asarray(spans, np.int64).reshape(-1, 2)


class TextFileSource:
    """Random access to the documents of plain-text files (UTF-8), read lazily by byte span.

    Only the spans are held in memory (16 bytes per document); ``source[i]`` is a str. Opening
    reads every file once (for the spans) and checks that it is UTF-8, so that a bad byte deep
    in a corpus is reported before training, not when its document is first drawn.
    """

    def __init__(self, files: Sequence[str], boundary: str = "blank_line"):
        self.files = [str(f) for f in files]
        per_file = []
        for i, f in enumerate(self.files):
            with open(f, "rb") as fh:
                spans = document_spans(utf8_lines(fh, f), boundary)
            per_file.append(np.concatenate([np.full((len(spans), 1), i, np.int64), spans], 1))
        self._docs = np.concatenate(per_file) if per_file else np.zeros((0, 3), np.int64)

    def __len__(self) -> int:
        return len(self._docs)

    def __getitem__(self, index: int) -> str:
        file_id, start, end = (int(v) for v in self._docs[index])
        with open(self.files[file_id], "rb") as fh:
            fh.seek(start)
            data = fh.read(end - start)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise not_utf8_error(self.files[file_id], e, offset=start) from e

    def __repr__(self) -> str:
        return f"TextFileSource({len(self.files)} files, {len(self)} documents)"


class TfdsTextSource:
    """A TFDS array_record split (``tfds.data_source``) viewed as its ``key`` text feature."""

    def __init__(self, name: str, split: str, data_dir: str, key: str):
        import tensorflow_datasets as tfds

        try:
            self._source = tfds.data_source(name, split=split, data_dir=data_dir or None,
                                            download=False)
        except Exception as e:  # tfds raises several unrelated types for a missing dataset
            raise ValueError(
                f"TFDS dataset {name!r} split {split!r} could not be opened from data_dir="
                f"{data_dir or '~/tensorflow_datasets'!r} ({error_summary(e)}); prepare it "
                f"as array_record (tfds build {name} --file_format=array_record) and set "
                "data.data_dir") from e
        features = getattr(self._source.dataset_info, "features", None)
        if features is not None and key not in features:
            raise ValueError(f"data.text_key={key!r} is not a feature of {name!r}: it has "
                             f"{sorted(features.keys())}")
        self.key = key

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> str:
        text = self._source[index][self.key]
        return text.decode("utf-8") if isinstance(text, bytes) else str(text)


def open_documents(cfg: ml_collections.ConfigDict, split: str) -> grain.MapDataset:
    """The documents (str) selected by a split spec."""
    if cfg.source == "tfds":
        documents = TfdsTextSource(cfg.tfds_name, sources.without_step(split), cfg.data_dir,
                                   cfg.text_key)
        return grain.MapDataset.source(documents)[::sources.split_step(split)]
    base, _, _ = sources.parse_split(split)
    source = TextFileSource(expand_files(cfg.text_files[base]), cfg.doc_boundary)
    return grain.MapDataset.source(Selected(source, sources.split_indices(split, len(source))))


class Selected:
    """The documents ``indices`` of ``source``, as a random-access source."""

    def __init__(self, source: Any, indices: np.ndarray):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> str:
        return self.source[int(self.indices[index])]

    def __repr__(self) -> str:
        return f"{self.source!r}[{len(self)} selected]"


# ----------------------------------------------------------------------------- tokenising


def encode_document(text: str, tokenizer: TextTokenizer, unk_marker: str = "") -> Encoded:
    """Token ids and word starts of one document; ``unk_marker`` occurrences -> unk id."""
    if not unk_marker or unk_marker not in text:
        return tokenizer.encode(text)
    parts = tokenizer.encode_batch(text.split(unk_marker))
    ids, starts = [parts[0].ids], [parts[0].word_starts]
    for part in parts[1:]:
        ids += [np.asarray([tokenizer.special.unk], np.int32), part.ids]
        starts += [np.ones(1, bool), part.word_starts]
    return Encoded(np.concatenate(ids), np.concatenate(starts))


# ----------------------------------------------------------------------------- packing


@dataclasses.dataclass(frozen=True)
class PackSpec:
    length: int
    cls_id: int
    sep_id: int
    pad_id: int


def packed_example(ids: list[np.ndarray], starts: list[np.ndarray], spec: PackSpec,
                   index: int) -> Example:
    """Concatenate the pieces and pad to ``spec.length``: input_ids (L,), word_starts (L,),
    length (number of real tokens) and the sequence's stream index."""
    ids_ = np.concatenate(ids)
    starts_ = np.concatenate(starts)
    n = len(ids_)
    out_ids = np.full(spec.length, spec.pad_id, np.int32)
    out_ids[:n] = ids_
    out_starts = np.zeros(spec.length, bool)
    out_starts[:n] = starts_
    return {"input_ids": out_ids, "word_starts": out_starts, "length": np.int32(n),
            "index": np.int64(index)}


class _PackIterator(grain.DatasetIterator):
    """Packs encoded documents into sequences (module docstring). State at a sequence boundary:
    the parent's state before the current document, the offset inside it, sequences emitted."""

    def __init__(self, parent: grain.DatasetIterator, spec: PackSpec):
        super().__init__(parent)
        self._spec = spec
        self._doc: Encoded | None = None
        self._doc_state: Any = None
        self._offset = 0
        self._count = 0

    def _fetch(self) -> None:
        """Load the next non-empty document (StopIteration at the end of the stream)."""
        while True:
            self._doc_state = self._parent.get_state()
            doc = next(self._parent)
            if len(doc.ids):
                self._doc, self._offset = doc, 0
                return

    def __next__(self) -> Example:
        spec = self._spec
        sep = (np.asarray([spec.sep_id], np.int32), np.ones(1, bool))
        ids, starts = [np.asarray([spec.cls_id], np.int32)], [np.ones(1, bool)]
        used = 1
        while True:
            if self._doc is None:
                try:
                    self._fetch()
                except StopIteration:
                    if used > 1:
                        break
                    raise
            doc, offset = self._doc, self._offset
            rest = len(doc.ids) - offset
            room = spec.length - used - 1                    # keep one slot for [SEP]
            if rest <= room:
                piece = slice(offset, None)
                self._doc = None
            elif used == 1:                                  # longer than an empty sequence
                piece = slice(offset, offset + room)
                self._offset += room
            else:                                            # starts the next sequence
                break
            piece_starts = doc.word_starts[piece]
            ids += [doc.ids[piece], sep[0]]
            starts += [piece_starts, sep[1]]
            used += len(piece_starts) + 1
            if self._doc is not None or spec.length - used - 1 < 1:
                break
        example = packed_example(ids, starts, spec, self._count)
        self._count += 1
        return example

    def get_state(self) -> dict[str, Any]:
        if self._doc is None:
            return {"parent": self._parent.get_state(), "offset": -1, "count": self._count}
        return {"parent": self._doc_state, "offset": self._offset, "count": self._count}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._count = int(state["count"])
        self._doc = None
        if int(state["offset"]) >= 0:
            self._fetch()
            self._offset = int(state["offset"])


class PackIterDataset(grain.IterDataset):
    """Encoded documents -> packed sequences ``[CLS] d1 [SEP] d2 [SEP] ...`` (module docstring)."""

    def __init__(self, parent: grain.IterDataset, spec: PackSpec):
        super().__init__(parent)
        self._spec = spec

    def __iter__(self) -> _PackIterator:
        return _PackIterator(self._parent.__iter__(), self._spec)

    def __str__(self) -> str:
        return f"PackIterDataset(length={self._spec.length})"


# ----------------------------------------------------------------------------- masking


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """What masking needs to know: rates, slots, the tokenizer's special and random ids."""

    mask_rate: float
    max_predictions: int
    mask_id: int
    special_ids: tuple[int, ...]
    vocab_size: int
    whole_word: bool = False
    mask_token_rate: float = 0.8
    random_token_rate: float = 0.1

    @functools.cached_property
    def random_ids(self) -> np.ndarray:
        """The ids a random replacement draws from: every non-special id."""
        return np.setdiff1d(np.arange(self.vocab_size, dtype=np.int32),
                            np.asarray(self.special_ids, np.int32))


def word_groups(candidates: np.ndarray, word_starts: np.ndarray) -> list[np.ndarray]:
    """Split sorted candidate positions into words: a word starts where ``word_starts`` is set
    or the previous position is not a candidate (i.e. after a special token)."""
    if len(candidates) == 0:
        return []
    new = word_starts[candidates].copy()
    new[0] = True
    new[1:] |= np.diff(candidates) != 1
    return np.split(candidates, np.flatnonzero(new)[1:])


def choose_masked_positions(candidates: np.ndarray, word_starts: np.ndarray, n: int,
                            whole_word: bool, rng: np.random.Generator) -> np.ndarray:
    """Sorted positions to predict: n of the candidates, or whole words totalling <= n tokens."""
    if not whole_word:
        return np.sort(rng.choice(candidates, size=n, replace=False))
    chosen: list[np.ndarray] = []
    total = 0
    groups = word_groups(candidates, word_starts)
    for g in rng.permutation(len(groups)):
        size = len(groups[g])
        if total + size > n:
            continue
        chosen.append(groups[g])
        total += size
        if total == n:
            break
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)


def mask_example(example: Example, spec: MaskSpec, rng: np.random.Generator) -> Example:
    """One packed sequence -> the MLM example (module docstring: masking and batch keys)."""
    ids = example["input_ids"]
    length = int(example["length"])
    real = np.arange(len(ids)) < length
    candidates = np.flatnonzero(real & ~np.isin(ids, spec.special_ids))
    n = min(spec.max_predictions, max(1, round(len(candidates) * spec.mask_rate)))
    n = min(n, len(candidates))
    positions = choose_masked_positions(candidates, example["word_starts"], n,
                                        spec.whole_word, rng)
    k = len(positions)
    u = rng.random(k)
    replaced = ids.copy()
    to_mask = u < spec.mask_token_rate
    to_random = (u >= spec.mask_token_rate) & (u < spec.mask_token_rate + spec.random_token_rate)
    replaced[positions[to_mask]] = spec.mask_id
    replaced[positions[to_random]] = rng.choice(spec.random_ids, size=int(to_random.sum()))
    m = spec.max_predictions
    masked_positions = np.zeros(m, np.int32)
    masked_ids = np.zeros(m, np.int32)
    masked_weights = np.zeros(m, np.float32)
    masked_positions[:k] = positions
    masked_ids[:k] = ids[positions]
    masked_weights[:k] = 1.0
    return {"input_ids": replaced.astype(np.int32),
            "attention_mask": real.astype(np.int32),
            "token_type_ids": np.zeros(len(ids), np.int32),
            "masked_positions": masked_positions,
            "masked_ids": masked_ids,
            "masked_weights": masked_weights,
            "mask": np.bool_(example.get("real", True))}


def seeded_mask(example: Example, spec: MaskSpec, seed: int) -> Example:
    """Mask with the RNG ``default_rng([seed, example['index']])``."""
    rng = np.random.default_rng([seed, int(example["index"])])
    return mask_example(example, spec, rng)


def mask_own_rows(global_batch: Sequence[Example], rows: slice, spec: MaskSpec,
                  seed: int) -> Example:
    """The rows ``rows`` of a global batch of packed sequences, masked and stacked."""
    return stack_examples([seeded_mask(e, spec, seed) for e in global_batch[rows]])


# ----------------------------------------------------------------------------- pipeline


@dataclasses.dataclass(frozen=True)
class TextPipeline:
    """A ready iterator plus what the task needs to know about the data.

    ``num_examples``: training: documents of the split over all shards; evaluation: packed
    sequences over all shards. ``num_batches``: eval batches per shard; None for training.
    """
    iterator: grain.DatasetIterator
    dataset: grain.IterDataset
    num_examples: int
    num_batches: int | None
    tokenizer: TextTokenizer


def mask_spec(cfg: ml_collections.ConfigDict, tokenizer: TextTokenizer) -> MaskSpec:
    return MaskSpec(mask_rate=float(cfg.mask_rate), max_predictions=max_predictions(cfg),
                    mask_id=tokenizer.special.mask,
                    special_ids=tuple(sorted(tokenizer.special_ids)),
                    vocab_size=tokenizer.vocab_size, whole_word=bool(cfg.whole_word),
                    mask_token_rate=float(cfg.mask_token_rate),
                    random_token_rate=float(cfg.random_token_rate))


def pack_spec(cfg: ml_collections.ConfigDict, tokenizer: TextTokenizer) -> PackSpec:
    s = tokenizer.special
    return PackSpec(int(cfg.max_seq_length), s.cls, s.sep, s.pad)


def pack_documents(documents: grain.MapDataset, tokenizer: TextTokenizer, spec: PackSpec,
                   unk_marker: str = "") -> list[Example]:
    """Pack a whole (finite) document source in order: the list of packed sequences."""
    encoded = documents.map(functools.partial(encode_document, tokenizer=tokenizer,
                                              unk_marker=unk_marker))
    return list(PackIterDataset(encoded.to_iter_dataset(), spec))


def make_mlm_pipeline(cfg: ml_collections.ConfigDict, *, split: str, batch_size: int,
                      seed: int, train: bool, shard_index: int = 0, shard_count: int = 1,
                      tokenizer: TextTokenizer | None = None) -> TextPipeline:
    """The MLM pipeline of ``cfg.train_split`` (split='train') or ``cfg.test_split`` ('test').

    ``batch_size`` is this shard's. train=True: infinite stream of full batches, rows
    [i·b, (i+1)·b) of the global batches (module docstring). train=False: one pass over this
    shard's packed test sequences, last batch padded with mask=False.
    """
    check_pipeline_call(split, batch_size, seed, shard_index, shard_count)
    validate_mlm_data_config(cfg)
    tokenizer = tokenizer or load_tokenizer(cfg.tokenizer, lowercase=bool(cfg.lowercase))
    documents = open_documents(cfg, cfg.train_split if split == "train" else cfg.test_split)
    num_docs = len(documents)
    pack, masking = pack_spec(cfg, tokenizer), mask_spec(cfg, tokenizer)
    encode = functools.partial(encode_document, tokenizer=tokenizer, unk_marker=cfg.unk_marker)
    if train:
        if num_docs == 0:
            raise ValueError(f"data.train_split={cfg.train_split!r} holds no documents; "
                             "widen the split")
        docs = documents.shuffle(seed=seed).repeat().map(encode)
        own_rows = slice(shard_index * batch_size, (shard_index + 1) * batch_size)
        ds = PackIterDataset(docs.to_iter_dataset(), pack).batch(
            batch_size * shard_count, drop_remainder=True,
            batch_fn=functools.partial(mask_own_rows, rows=own_rows, spec=masking, seed=seed))
        return TextPipeline(iter(ds), ds, num_docs, None, tokenizer)
    sequences = pack_documents(documents, tokenizer, pack, cfg.unk_marker)
    if len(sequences) < shard_count:
        raise ValueError(f"data.test_split={cfg.test_split!r} packs into {len(sequences)} "
                         f"sequences, fewer than shard_count={shard_count}; widen the split")
    mine = sequences[shard_index::shard_count]
    num_batches = eval_batches_per_shard(len(sequences), shard_count, batch_size)
    padded = [dict(e, real=True) for e in mine]
    padded += [dict(mine[i % len(mine)], real=False)
               for i in range(num_batches * batch_size - len(mine))]
    ds = grain.MapDataset.source(padded).map(
        functools.partial(seeded_mask, spec=masking, seed=EVAL_MASK_SEED))
    ds = ds.batch(batch_size, drop_remainder=True, batch_fn=stack_examples).to_iter_dataset()
    return TextPipeline(iter(ds), ds, len(sequences), num_batches, tokenizer)
