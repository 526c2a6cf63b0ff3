"""Suite ``pipelines``: examples/s of the Grain input pipelines vs what a train step consumes.

Image: ``posjax.data.images`` on CIFAR-10 (``../shared/data/cifar10``) resized to the ViT input
with random-resized-crop and flip (scikit-learn's bundled digits when CIFAR-10 is absent).
Text: ``posjax.data.text`` MLM pipeline (packing + dynamic masking) on WikiText-2 valid with the
BERT uncased vocabulary (``../shared/data``); a small generated corpus and vocabulary in smoke
mode or when those files are absent. Both read in the main process (``worker_count=0``).
The consumption column is the ``throughput`` suite's ours examples/s for the matching model
measured earlier in the same invocation.
"""
from __future__ import annotations

import pathlib
import tempfile
import time

from bench.common import Budget, Progress, Scale, Table
from bench.workloads import throughput_workloads

SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


def examples_per_second(iterator, batch_size: int, batches: int, seconds: float) -> float:
    """Examples/s over up to ``batches`` batches or ``seconds`` (after one warm-up batch)."""
    next(iterator)
    t0 = time.perf_counter()
    n = 0
    while n < batches and (n == 0 or time.perf_counter() - t0 < seconds):
        next(iterator)
        n += 1
    return n * batch_size / (time.perf_counter() - t0)


def image_pipeline(scale: Scale, image_size: int, batch: int):
    from posjax.data import images
    cifar = SHARED_DATA / "cifar10"
    if not scale.smoke and (cifar / "train_20k.npz").is_file():
        cfg = images.default_data_config("cifar10")
        cfg.path = str(cifar)
        source = "CIFAR-10 train_20k (32 px)"
    else:
        cfg = images.default_data_config("digits")
        cfg.random_resized_crop, cfg.flip = True, True
        source = "scikit-learn digits (8 px, 1 channel)"
    cfg.image_size = image_size
    pipe = images.make_image_pipeline(cfg, split="train", batch_size=batch, seed=0, train=True)
    return pipe.iterator, f"{source} → {image_size} px, crop + flip"


def _tiny_corpus(folder: pathlib.Path) -> tuple[str, str]:
    """A generated word-level corpus and WordPiece vocabulary (no external files)."""
    words = [f"w{i}" for i in range(200)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    lines = []
    for d in range(200):
        lines += [" ".join(words[(d * 7 + i * 13) % 200] for i in range(5 + d % 40)), ""]
    (folder / "corpus.txt").write_text("\n".join(lines))
    return str(folder / "corpus.txt"), str(folder / "vocab.txt")


def text_pipeline(scale: Scale, length: int, batch: int, tmp: pathlib.Path):
    from posjax.data import text
    wiki = SHARED_DATA / "wikitext-2" / "valid.txt"
    vocab = SHARED_DATA / "bert-base-uncased-vocab" / "vocab.txt"
    cfg = text.default_mlm_data_config()
    if not scale.smoke and wiki.is_file() and vocab.is_file():
        corpus, tokenizer, source = str(wiki), str(vocab), "WikiText-2 valid, BERT WordPiece"
        cfg.unk_marker = "<unk>"
    else:
        corpus, tokenizer = _tiny_corpus(tmp)
        source = "generated corpus, 205-token vocabulary"
    cfg.text_files = {"train": corpus}
    cfg.tokenizer = tokenizer
    cfg.max_seq_length = length
    pipe = text.make_mlm_pipeline(cfg, split="train", batch_size=batch, seed=0, train=True)
    return pipe.iterator, f"{source}, L = {length}, packing + 15% masking"


def run(scale: Scale, budget: Budget, context: dict) -> list[Table]:
    workloads = {w.cfg.position_scheme: w for w in throughput_workloads(scale.name, scale.dtype)}
    vit, bert = workloads["vit"], workloads["bert_abs"]
    consumed = context.get("train_examples_per_s", {})
    batches, seconds = (3, 5.0) if scale.smoke else (200, 20.0)
    rows = []
    progress = Progress("pipelines", [1.0, 1.0])
    with tempfile.TemporaryDirectory() as tmp:
        for kind, w, make in (("image", vit, lambda: image_pipeline(scale, vit.cfg.image_size[0],
                                                                     vit.batch)),
                              ("text (MLM)", bert, lambda: text_pipeline(
                                  scale, bert.length, bert.batch, pathlib.Path(tmp)))):
            if budget.left() <= 0:
                rows.append([kind, "—", w.batch, None, w.name, consumed.get(w.name), None])
                continue
            iterator, what = make()
            rate = examples_per_second(iterator, w.batch, batches, seconds)
            need = consumed.get(w.name)
            rows.append([kind, what, w.batch, rate, w.name, need,
                         rate / need if need else None])
            progress.tick(f"{kind} pipeline ({rate:.0f} examples/s)")
    notes = ["headroom = pipeline examples/s ÷ train-step examples/s (> 1: the step, not the "
             "input, is the bottleneck), one process, no worker processes.",
             "train ex/s comes from the throughput suite in the same invocation (— if it "
             "was not run)."]
    return [Table("Input pipelines vs train-step consumption",
                  ["pipeline", "data", "batch", "pipeline ex/s", "consumer", "train ex/s",
                   "headroom"], rows, notes)]

