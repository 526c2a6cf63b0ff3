"""GLUE: the nine tasks from TFDS ``glue/*`` or the GLUE download layout, their official metrics,
and prediction files in the GLUE submission format.

Configuration (``default_glue_data_config(task)``; ``validate_glue_data_config`` checks it, and
that both splits can be read, before anything is compiled or written):

================ ============================================================================
key              meaning
================ ============================================================================
task             cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli
glue_dir         root of the GLUE download layout (``<glue_dir>/SST-2/train.tsv``, ...); when
                 empty, TFDS ``glue/<task>`` (array_record) is read from ``data_dir``
data_dir         TFDS data dir ('' = ``~/tensorflow_datasets``)
train_split      ``train`` (an optional slice as in TFDS: ``train[:10%]``)
test_split       the evaluated split: ``validation`` (MNLI: ``validation_matched`` /
                 ``validation_mismatched``), ``test`` (MNLI: ``test_matched`` /
                 ``test_mismatched``; ``diagnostic`` = the AX set, read by an MNLI model)
tokenizer        vocab.txt / SentencePiece .model / tokenizer.json (posjax.data.tokenizers)
lowercase        WordPiece vocab.txt only: lower-case (BERT uncased)
max_seq_length   L; pairs are ``[CLS] a [SEP] b [SEP]`` (token types 0 .. 0 1 .. 1), single
                 sentences ``[CLS] a [SEP]``; longer inputs are truncated longest-first
                 (as Hugging Face tokenizers cut pairs), counted and reported
================ ============================================================================

TSV quirks handled: quoting disabled (``csv.QUOTE_NONE``: GLUE text holds bare ``"``), an
optional UTF-8 BOM (MRPC), CoLA train/dev without a header (``source, label, orig_label,
sentence``), a missing final newline. Columns are found by header name. Labels are stored as
the index into the task's label names, in TFDS order (MNLI: entailment, neutral,
contradiction), so TSV and TFDS runs agree; STS-B labels are float scores in [0, 5].

Bad input: an empty line is skipped and counted; a row with the wrong column count, an
unknown or non-numeric label, or no text is skipped and counted with its line number; more
than ``MAX_BAD_FRACTION`` of bad rows in a training split, or any bad row in the evaluated
split (its metrics must be those of the official set, and a submission must hold every
example), raises ValueError naming the file. A header lacking the
task's columns (wrong folder or task) raises at once, and so does a byte that is not UTF-8
(naming its line).

Metrics (``glue_metrics``): accuracy; F1 of the positive class (MRPC, QQP); Matthews
correlation (CoLA); Pearson and Spearman correlation (STS-B). Submission files
(``write_submission``): ``<Task>.tsv`` (test splits; ``<Task>.<split>.tsv`` for the others)
with header ``index<TAB>prediction``, rows in ``idx`` order; predictions are the TSV label
spelling (0/1, or entailment/... for MNLI, QNLI, RTE, AX), STS-B scores clipped to [0, 5]
with 3 decimals.
"""
from __future__ import annotations

import csv
import dataclasses
import logging
import math
import pathlib
from typing import Any, Sequence

import grain
import ml_collections
import numpy as np

from posjax import config_defaults
from posjax.data import sources
from posjax.data.common import (check_pipeline_call, eval_batches_per_shard, key_problems,
                                pad_to_full_batches, stack_examples, utf8_lines)
from posjax.data.tokenizers import TextTokenizer, load_tokenizer
from posjax.io_utils import error_summary, write_text_atomically

MAX_BAD_FRACTION = 0.01
Example = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class GlueTask:
    """Where one GLUE task's data lives and how to read and score it."""

    name: str
    folder: str                          # GLUE download folder
    tsv_text: tuple[str, ...]            # TSV header names of the sentence(s)
    tsv_label: str                       # TSV header name of the label
    tsv_label_values: tuple[str, ...]    # label spelling in the TSV, in ``labels`` order
    tfds_text: tuple[str, ...]           # TFDS feature names of the sentence(s)
    labels: tuple[str, ...]              # label names, TFDS order; () = regression
    metrics: tuple[str, ...]
    submission: str                      # submission file stem for the test split
    headerless: tuple[str, ...] = ()     # column names of train/dev files without a header

    @property
    def num_labels(self) -> int:
        """Classifier outputs: the number of classes, 1 for regression."""
        return len(self.labels) or 1

    @property
    def is_regression(self) -> bool:
        return not self.labels

    def files(self) -> dict[str, str]:
        """Split name -> TSV path relative to the GLUE root."""
        if self.name == "mnli":
            return {"train": "MNLI/train.tsv",
                    "validation_matched": "MNLI/dev_matched.tsv",
                    "validation_mismatched": "MNLI/dev_mismatched.tsv",
                    "test_matched": "MNLI/test_matched.tsv",
                    "test_mismatched": "MNLI/test_mismatched.tsv",
                    "diagnostic": "diagnostic/diagnostic.tsv"}
        return {s: f"{self.folder}/{f}.tsv"
                for s, f in (("train", "train"), ("validation", "dev"), ("test", "test"))}


BINARY = ("0", "1")
NLI3 = ("entailment", "neutral", "contradiction")
NLI2 = ("entailment", "not_entailment")

TASKS: dict[str, GlueTask] = {t.name: t for t in (
    GlueTask("cola", "CoLA", ("sentence",), "label", BINARY, ("sentence",),
             ("unacceptable", "acceptable"), ("mcc",), "CoLA",
             headerless=("source", "label", "orig_label", "sentence")),
    GlueTask("sst2", "SST-2", ("sentence",), "label", BINARY, ("sentence",),
             ("negative", "positive"), ("accuracy",), "SST-2"),
    GlueTask("mrpc", "MRPC", ("#1 String", "#2 String"), "Quality", BINARY,
             ("sentence1", "sentence2"), ("not_equivalent", "equivalent"),
             ("f1", "accuracy"), "MRPC"),
    GlueTask("qqp", "QQP", ("question1", "question2"), "is_duplicate", BINARY,
             ("question1", "question2"), ("not_duplicate", "duplicate"), ("f1", "accuracy"),
             "QQP"),
    GlueTask("stsb", "STS-B", ("sentence1", "sentence2"), "score", (),
             ("sentence1", "sentence2"), (), ("pearson", "spearman"), "STS-B"),
    GlueTask("mnli", "MNLI", ("sentence1", "sentence2"), "gold_label", NLI3,
             ("premise", "hypothesis"), NLI3, ("accuracy",), "MNLI"),
    GlueTask("qnli", "QNLI", ("question", "sentence"), "label", NLI2,
             ("question", "sentence"), NLI2, ("accuracy",), "QNLI"),
    GlueTask("rte", "RTE", ("sentence1", "sentence2"), "label", NLI2,
             ("sentence1", "sentence2"), NLI2, ("accuracy",), "RTE"),
    GlueTask("wnli", "WNLI", ("sentence1", "sentence2"), "label", BINARY,
             ("sentence1", "sentence2"), ("not_entailment", "entailment"), ("accuracy",),
             "WNLI"),
)}
STS_RANGE = (0.0, 5.0)


def get_task(name: str) -> GlueTask:
    if name not in TASKS:
        raise ValueError(f"GLUE task {name!r} is unknown: choose one of {', '.join(TASKS)}")
    return TASKS[name]


def is_test_split(split: str) -> bool:
    """Test splits carry no labels (``test``, ``test_matched``, ``diagnostic``, ...)."""
    base, _, _ = sources.parse_split(split)
    return base.startswith("test") or base == "diagnostic"


def submission_name(task: GlueTask, split: str) -> str:
    """The GLUE server's file name for a test split's predictions (``SST-2.tsv``, ``MNLI-m.tsv``,
    ``AX.tsv``); other splits get the split in the name (``SST-2.validation.tsv``)."""
    base, _, _ = sources.parse_split(split)
    official = {"diagnostic": "AX", "test_matched": "MNLI-m", "test_mismatched": "MNLI-mm",
                "test": task.submission}
    return f"{official[base]}.tsv" if base in official else f"{task.submission}.{base}.tsv"


# ----------------------------------------------------------------------------- TSV reading


@dataclasses.dataclass
class ReadReport:
    """What reading a split skipped or changed (all counts are rows/examples)."""

    path: str
    rows: int = 0
    kept: int = 0
    empty_lines: int = 0
    bad_rows: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    truncated: int = 0

    def summary(self) -> str:
        bad = "; ".join(f"line {n}: {why}" for n, why in self.bad_rows[:5])
        more = f" (+{len(self.bad_rows) - 5} more)" if len(self.bad_rows) > 5 else ""
        return (f"{self.path}: {self.kept} examples kept of {self.rows} rows, "
                f"{len(self.bad_rows)} bad rows skipped{': ' + bad + more if bad else ''}, "
                f"{self.empty_lines} empty lines skipped, {self.truncated} examples truncated")


def parse_label(task: GlueTask, value: str) -> int | float:
    """The stored label of a TSV label string; ValueError when it is not one of the task's."""
    value = value.strip()
    if task.is_regression:
        score = float(value)
        if not (STS_RANGE[0] <= score <= STS_RANGE[1]) or math.isnan(score):
            raise ValueError(f"score {value!r} outside {list(STS_RANGE)}")
        return score
    if value not in task.tsv_label_values:
        raise ValueError(f"label {value!r} is not one of {list(task.tsv_label_values)}")
    return task.tsv_label_values.index(value)


def read_tsv(path: str | pathlib.Path, task: GlueTask, labelled: bool, every_row: bool = False
             ) -> tuple[list[Example], ReadReport]:
    """Examples ``{'text': (a,) or (a, b), 'label': int/float or None, 'idx': int}`` of one GLUE
    TSV file, and the report of what was skipped (module docstring: bad input; ``every_row``:
    the split is evaluated, a bad row is an error)."""
    path = pathlib.Path(path)
    report = ReadReport(str(path))
    if not path.is_file():
        raise ValueError(f"GLUE file {str(path)!r} does not exist: set data.glue_dir to the "
                         f"folder holding {task.folder}/ (the GLUE download layout)")
    examples: list[Example] = []
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(utf8_lines(f, path), delimiter="\t", quoting=csv.QUOTE_NONE)
        header = list(task.headerless) if (labelled and task.headerless) else next(reader, None)
        if header is None:
            raise ValueError(f"GLUE file {str(path)!r} is empty")
        header = [h.strip() for h in header]
        wanted = list(task.tsv_text) + ([task.tsv_label] if labelled else [])
        missing = [c for c in wanted if c not in header]
        if missing:
            raise ValueError(f"GLUE file {str(path)!r} has columns {header} but task "
                             f"{task.name!r} needs {missing}: check data.task and data.glue_dir")
        text_cols = [header.index(c) for c in wanted[:len(task.tsv_text)]]
        label_col = header.index(task.tsv_label) if labelled else None
        idx_col = next((header.index(c) for c in ("index", "id") if c in header), None)
        for row in reader:
            line = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                report.empty_lines += 1
                continue
            report.rows += 1
            if len(row) != len(header):
                report.bad_rows.append((line, f"{len(row)} columns, expected {len(header)}"))
                continue
            text = tuple(row[c].strip() for c in text_cols)
            if not all(text):
                report.bad_rows.append((line, "empty sentence"))
                continue
            try:
                label = parse_label(task, row[label_col]) if labelled else None
                idx = int(row[idx_col]) if idx_col is not None else report.rows - 1
            except ValueError as e:
                report.bad_rows.append((line, str(e)))
                continue
            examples.append({"text": text, "label": label, "idx": idx})
    report.kept = len(examples)
    _check_bad_rows(report, labelled, every_row)
    return examples, report


def _check_bad_rows(report: ReadReport, labelled: bool, every_row: bool) -> None:
    bad = len(report.bad_rows)
    if bad and (not labelled or every_row or bad > MAX_BAD_FRACTION * max(report.rows, 1)):
        why = ("a test split must keep every row for the submission" if not labelled else
               "an evaluated split must keep every row (else its metrics are not the official "
               "set's)" if every_row else f"more than {MAX_BAD_FRACTION:.0%} of the rows are bad")
        raise ValueError(f"{report.summary()}: {why}; fix the file or check data.task")


def open_tfds(task: GlueTask, split: str, data_dir: str) -> tuple[Any, str, str]:
    """(random-access source, TFDS name, TFDS split) of a split of TFDS ``glue/<task>``
    (``diagnostic`` = ``glue/ax`` test); opening reads no records."""
    import tensorflow_datasets as tfds

    try:  # registers the GLUE builder (needed for mock data; prepared data is read without it)
        import tensorflow_datasets.text.glue  # noqa: F401
    except ImportError:
        pass
    base, _, _ = sources.parse_split(split)
    name = "glue/ax" if base == "diagnostic" else f"glue/{task.name}"
    tfds_split = split.replace("diagnostic", "test", 1) if base == "diagnostic" else split
    try:
        source = tfds.data_source(name, split=tfds_split, data_dir=data_dir or None,
                                  download=False)
    except Exception as e:  # tfds raises several unrelated types for a missing dataset
        raise ValueError(
            f"TFDS {name!r} split {tfds_split!r} could not be opened from data_dir="
            f"{data_dir or '~/tensorflow_datasets'!r} ({error_summary(e)}); prepare it as "
            f"array_record or set data.glue_dir to a GLUE download folder") from e
    return source, name, tfds_split


def read_tfds(task: GlueTask, split: str, data_dir: str, every_row: bool = False
              ) -> tuple[list[Example], ReadReport]:
    """The same examples from TFDS ``glue/<task>`` (``diagnostic`` = ``glue/ax`` test)."""
    source, name, tfds_split = open_tfds(task, split, data_dir)
    base, _, _ = sources.parse_split(split)
    labelled = not is_test_split(split)
    report = ReadReport(f"tfds:{name}[{tfds_split}]")
    examples = []
    fields = ("premise", "hypothesis") if base == "diagnostic" else task.tfds_text
    for i in range(len(source)):
        ex = source[i]
        report.rows += 1
        text = tuple(_text(ex[k]).strip() for k in fields)
        if not all(text):
            report.bad_rows.append((i, "empty sentence"))
            continue
        label = None
        if labelled:
            raw = ex["label"]
            label = float(raw) if task.is_regression else int(raw)
            if not task.is_regression and not 0 <= label < len(task.labels):
                report.bad_rows.append((i, f"label {label} outside 0..{len(task.labels) - 1}"))
                continue
        examples.append({"text": text, "label": label, "idx": int(ex["idx"])})
    report.kept = len(examples)
    _check_bad_rows(report, labelled, every_row)
    return examples, report


def _text(v: Any) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def read_split(cfg: ml_collections.ConfigDict, split: str, evaluated: bool = False
               ) -> tuple[list[Example], ReadReport]:
    """The examples of a split spec (with its optional slice) from TSV or TFDS; ``evaluated``
    (the run's test split): any bad row is an error, not only more than 1 % of them."""
    task = get_task(cfg.task)
    base, _, _ = sources.parse_split(split)
    if not cfg.glue_dir:
        return read_tfds(task, split, cfg.data_dir, every_row=evaluated)
    files = task.files()
    if base not in files:
        raise ValueError(f"split {split!r} does not exist for GLUE task {task.name!r}: choose "
                         f"one of {', '.join(files)}")
    path = pathlib.Path(cfg.glue_dir).expanduser() / files[base]
    examples, report = read_tsv(path, task, labelled=not is_test_split(split),
                                every_row=evaluated)
    selected = sources.split_range(split, len(examples))
    return examples[selected.start:selected.stop:selected.step], report


# ----------------------------------------------------------------------------- encoding


def truncate_longest_first(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Cut the ends of ``a`` and ``b`` to ``len(a) + len(b) <= budget`` longest-first, as Hugging
    Face tokenizers do: a piece shorter than half the budget is kept whole and the other takes
    the rest; otherwise both keep ``budget // 2`` and the longer one (b on ties) takes the odd
    token. (Google BERT's ``_truncate_seq_pair`` gives that token to a.)"""
    if len(a) + len(b) <= budget:
        return list(a), list(b)
    a_is_shorter = len(a) <= len(b)
    shorter = min(len(a), len(b))
    keep_shorter = shorter if 2 * shorter <= budget else budget // 2
    keep_a, keep_b = ((keep_shorter, budget - keep_shorter) if a_is_shorter
                      else (budget - keep_shorter, keep_shorter))
    return list(a[:keep_a]), list(b[:keep_b])


def assemble(parts: Sequence[Sequence[int]], tokenizer: TextTokenizer, length: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """``[CLS] a [SEP] (b [SEP])`` padded to ``length``: (input_ids, attention_mask,
    token_type_ids) and whether the input was truncated (longest-first)."""
    s = tokenizer.special
    if len(parts) == 1:
        a, b = list(parts[0][:length - 2]), None
        truncated = len(parts[0]) > length - 2
    else:
        a, b = truncate_longest_first(parts[0], parts[1], length - 3)
        truncated = len(a) + len(b) < len(parts[0]) + len(parts[1])
    ids = [s.cls] + a + [s.sep]
    types = [0] * len(ids)
    if b is not None:
        ids += b + [s.sep]
        types += [1] * (len(b) + 1)
    n, pad = len(ids), length - len(ids)
    return (np.asarray(ids + [s.pad] * pad, np.int32), np.asarray([1] * n + [0] * pad, np.int32),
            np.asarray(types + [0] * pad, np.int32), truncated)


def encode_examples(examples: Sequence[Example], tokenizer: TextTokenizer, length: int,
                    regression: bool, report: ReadReport) -> list[Example]:
    """Encode every example (module docstring: batch keys); counts truncations into
    ``report.truncated``."""
    columns = [tokenizer.encode_batch([ex["text"][c] for ex in examples])
               for c in range(len(examples[0]["text"]))] if examples else []
    out = []
    for i, ex in enumerate(examples):
        ids, attention, types, truncated = assemble([col[i].ids.tolist() for col in columns],
                                                    tokenizer, length)
        report.truncated += int(truncated)
        label = ex["label"] or 0
        out.append({"input_ids": ids, "attention_mask": attention, "token_type_ids": types,
                    "label": np.float32(label) if regression else np.int32(label),
                    "idx": np.int32(ex["idx"]), "mask": np.bool_(True)})
    return out


# ----------------------------------------------------------------------------- metrics


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.asarray(predictions) == np.asarray(labels)))


def confusion(predictions: np.ndarray, labels: np.ndarray) -> tuple[int, int, int, int]:
    """(TP, FP, FN, TN) with class 1 positive."""
    p, y = np.asarray(predictions) == 1, np.asarray(labels) == 1
    return (int(np.sum(p & y)), int(np.sum(p & ~y)), int(np.sum(~p & y)), int(np.sum(~p & ~y)))


def f1_score(predictions: np.ndarray, labels: np.ndarray) -> float:
    """F1 of class 1: 2TP / (2TP + FP + FN) (0 when there is no positive at all)."""
    tp, fp, fn, _ = confusion(predictions, labels)
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def matthews_corrcoef(predictions: np.ndarray, labels: np.ndarray) -> float:
    """MCC = (TP·TN − FP·FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)); 0 when undefined."""
    tp, fp, fn, tn = confusion(predictions, labels)
    denominator = math.sqrt(float(tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / denominator if denominator else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """r = Σ(x−x̄)(y−ȳ) / sqrt(Σ(x−x̄)² Σ(y−ȳ)²), in float64 (0 for a constant input)."""
    x = np.asarray(x, np.float64) - np.mean(x)
    y = np.asarray(y, np.float64) - np.mean(y)
    denominator = math.sqrt(float(np.sum(x * x) * np.sum(y * y)))
    return float(np.sum(x * y) / denominator) if denominator else 0.0


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their mean rank."""
    x = np.asarray(x)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's ρ: the Pearson correlation of the average ranks."""
    return pearson(average_ranks(x), average_ranks(y))


METRICS = {"accuracy": accuracy, "f1": f1_score, "mcc": matthews_corrcoef,
           "pearson": pearson, "spearman": spearman}


def glue_metrics(task: GlueTask, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The task's official metrics and their mean ``score`` (the leaderboard's task score)."""
    out = {m: METRICS[m](predictions, labels) for m in task.metrics}
    out["score"] = float(np.mean(list(out.values())))
    return out


# ----------------------------------------------------------------------------- submission


def prediction_strings(task: GlueTask, predictions: np.ndarray) -> list[str]:
    """Class ids -> the TSV label spelling; STS-B scores -> clipped, 3 decimals."""
    if task.is_regression:
        return [f"{v:.3f}" for v in np.clip(np.asarray(predictions, np.float64), *STS_RANGE)]
    return [task.tsv_label_values[int(p)] for p in predictions]


def write_submission(task: GlueTask, split: str, idx: np.ndarray, predictions: np.ndarray,
                     directory: str | pathlib.Path) -> pathlib.Path:
    """Write ``<directory>/<Task>.tsv`` (``index<TAB>prediction``, sorted by index); the file is
    replaced atomically, so a crash never leaves a partial file."""
    idx = np.asarray(idx)
    if len(idx) != len(predictions):
        raise ValueError(f"{len(idx)} indices but {len(predictions)} predictions")
    if len(np.unique(idx)) != len(idx):
        raise ValueError("duplicate example indices: the evaluation padding was not dropped")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / submission_name(task, split)
    order = np.argsort(idx, kind="stable")
    text = prediction_strings(task, np.asarray(predictions)[order])
    lines = ["index\tprediction\n"] + [f"{int(i)}\t{t}\n" for i, t in zip(idx[order], text)]
    write_text_atomically(path, "".join(lines))
    return path


# ----------------------------------------------------------------------------- pipeline


def default_glue_data_config(task: str = "sst2") -> ml_collections.ConfigDict:
    """Every GLUE data key with its default (``config_defaults.glue_data_config``)."""
    get_task(task)
    return config_defaults.glue_data_config(task)


def validate_glue_data_config(cfg: ml_collections.ConfigDict) -> None:
    """Raises one ValueError listing every problem (field, value, fix), including a split
    whose TSV file is missing or that TFDS cannot open."""
    keys = key_problems(cfg, default_glue_data_config(),
                        "posjax.data.glue.default_glue_data_config(task)")
    if keys:
        raise ValueError("bad GLUE data config:\n  " + "\n  ".join(keys))
    out = []
    if cfg.task not in TASKS:
        out.append(f"data.task={cfg.task!r}: choose one of {', '.join(TASKS)}")
    if not (isinstance(cfg.max_seq_length, int) and cfg.max_seq_length >= 8):
        out.append(f"data.max_seq_length={cfg.max_seq_length!r}: must be an integer >= 8")
    if not cfg.tokenizer or not pathlib.Path(str(cfg.tokenizer)).expanduser().exists():
        out.append(f"data.tokenizer={cfg.tokenizer!r}: set it to an existing vocab.txt, "
                   "SentencePiece .model or tokenizer.json")
    if cfg.glue_dir and not pathlib.Path(cfg.glue_dir).expanduser().is_dir():
        out.append(f"data.glue_dir={cfg.glue_dir!r}: not a folder; give the GLUE download "
                   "root holding CoLA/, SST-2/, ... (or '' for TFDS)")
    for field in ("train_split", "test_split"):
        try:
            base, _, _ = sources.parse_split(cfg[field])
        except (ValueError, AttributeError) as e:
            out.append(f"data.{field}={cfg[field]!r}: {e}")
            continue
        if cfg.task in TASKS and base not in TASKS[cfg.task].files():
            out.append(f"data.{field}={cfg[field]!r}: task {cfg.task!r} has the splits "
                       f"{', '.join(TASKS[cfg.task].files())}")
    if not out and is_test_split(cfg.train_split):
        out.append(f"data.train_split={cfg.train_split!r}: a test split has no labels")
    if not out:
        out = split_problems(cfg)
    if out:
        raise ValueError("bad GLUE data config:\n  " + "\n  ".join(out))


def split_problems(cfg: ml_collections.ConfigDict) -> list[str]:
    """Each of the two splits must be readable: its TSV file exists under ``glue_dir``, or TFDS
    opens it (only the first TFDS failure is reported: it is usually the dataset's)."""
    task = get_task(cfg.task)
    out = []
    for field in ("train_split", "test_split"):
        base, _, _ = sources.parse_split(cfg[field])
        if cfg.glue_dir:
            path = pathlib.Path(cfg.glue_dir).expanduser() / task.files()[base]
            if not path.is_file():
                out.append(f"data.{field}={cfg[field]!r}: GLUE file {str(path)!r} does not "
                           f"exist; put it there or choose another split of {task.name}")
            continue
        try:
            open_tfds(task, cfg[field], cfg.data_dir)
        except ValueError as e:
            out.append(f"data.{field}={cfg[field]!r}: {e}")
            break
    return out


@dataclasses.dataclass(frozen=True)
class GluePipeline:
    """A ready iterator plus what the task needs to know about the data.

    ``num_examples``: examples of the split over all shards; ``num_batches``: eval batches per
    shard (None for training); ``report``: what reading and encoding skipped or truncated.
    """
    iterator: grain.DatasetIterator
    dataset: grain.IterDataset
    num_examples: int
    num_batches: int | None
    report: ReadReport
    labelled: bool


def _mark_padding(example: Example, *, real: bool) -> Example:
    """Evaluation padding: a repeated example gets mask False."""
    return example if real else dict(example, mask=np.bool_(False))


def make_glue_pipeline(cfg: ml_collections.ConfigDict, *, split: str, batch_size: int,
                       seed: int, train: bool, shard_index: int = 0, shard_count: int = 1,
                       tokenizer: TextTokenizer | None = None) -> GluePipeline:
    """The pipeline of ``cfg.train_split`` (split='train') or ``cfg.test_split`` ('test').

    Batches: ``input_ids``, ``attention_mask``, ``token_type_ids`` int32 (b, L); ``label``
    int32 (b,) (float32 for STS-B; 0 on test splits); ``idx`` int32 (b,); ``mask`` bool (b,).
    train=True: infinite, reshuffled each epoch, the same global batches (one permutation of
    the split per epoch) for any ``shard_count``; train=False: one pass over examples
    ``i, i+n, ...``, padded last batch.
    """
    check_pipeline_call(split, batch_size, seed, shard_index, shard_count)
    validate_glue_data_config(cfg)
    task = get_task(cfg.task)
    spec = cfg.train_split if split == "train" else cfg.test_split
    tokenizer = tokenizer or load_tokenizer(cfg.tokenizer, lowercase=bool(cfg.lowercase))
    examples, report = read_split(cfg, spec, evaluated=split == "test")
    if len(examples) < shard_count:
        raise ValueError(f"data.{split}_split={spec!r} holds {len(examples)} examples, fewer "
                         f"than shard_count={shard_count}; widen the split")
    encoded = encode_examples(examples, tokenizer, int(cfg.max_seq_length), task.is_regression,
                              report)
    changed = report.bad_rows or report.empty_lines or report.truncated
    logging.log(logging.WARNING if changed else logging.INFO, "GLUE %s %s: %s", task.name, spec,
                report.summary())
    ds = grain.MapDataset.source(encoded)
    if train:   # shard i of n: rows [i·b, (i+1)·b) of global batches of b·n examples
        ds = ds.shuffle(seed=seed).repeat().batch(batch_size, drop_remainder=True,
                                                  batch_fn=stack_examples)
        ds = ds[shard_index::shard_count]
        num_batches = None
    else:
        num_batches = eval_batches_per_shard(len(encoded), shard_count, batch_size)
        ds = pad_to_full_batches(ds[shard_index::shard_count], num_batches, batch_size,
                                 _mark_padding)
        ds = ds.batch(batch_size, drop_remainder=True, batch_fn=stack_examples)
    iter_ds = ds.to_iter_dataset()
    return GluePipeline(iter(iter_ds), iter_ds, len(encoded), num_batches, report,
                        labelled=not is_test_split(spec))
