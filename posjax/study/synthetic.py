"""Synthetic position tasks as per-position token prediction through the MLM machinery
(``task='position_synth'``): the same model, head, loss and batch keys as masked-LM (inputs,
then masked_positions / masked_ids / masked_weights per predicted slot), data generated from
the seed with numpy (no files).

Ids: 0 [PAD], 1 [CLS], 2 [MARK], content tokens 3 .. 3+V-1, count answers after them.
A sequence of ``length`` n is [CLS] x_1 .. x_{n-1}. Tasks (``data.task``):

* ``shift``: predict x_{i-k} at every position i > k (``data.shift`` = k): copy from k to the left.
* ``reverse``: predict x_{n-i} at position i: the whole content reversed.
* ``count``: markers appear with probability 0.15; at each marker predict how many tokens
  lie between it and the previous marker (or [CLS]), capped at ``data.max_count``.

Accuracy is the share of predicted slots right. ``data.length`` may change at evaluation
(the study evaluates at L, 2L and 4L).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import grain
import ml_collections
import numpy as np

from posjax.models import flops
from posjax.training.tasks import register_task
from posjax.training.text_tasks import MaskedLanguageModel, mlm_head_flops

TASKS = ("shift", "reverse", "count")
FIRST_CONTENT = 3
MARK = 2
TRAIN_STREAMS = 10**9


def default_data_config(task: str = "shift", length: int = 32) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"task": task, "length": length, "vocab": 16, "shift": 3,
                                      "max_count": 15, "num_eval": 256, "max_seq_length": length})


def vocab_size(data: Any) -> int:
    """Ids the task uses, rounded up to a multiple of 8."""
    n = FIRST_CONTENT + int(data.vocab) + int(data.max_count) + 1
    return -(-n // 8) * 8


def num_slots(data: Any) -> int:
    n = int(data.length)
    return {"shift": n - 1 - int(data.shift), "reverse": n - 1}.get(data.task, n - 1)


def make_example(data: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    n, v, m = int(data.length), int(data.vocab), num_slots(data)
    x = rng.integers(FIRST_CONTENT, FIRST_CONTENT + v, size=n)
    x[0] = 1
    positions = np.zeros(m, np.int32)
    targets = np.zeros(m, np.int32)
    weights = np.zeros(m, np.float32)
    if data.task == "shift":
        k = int(data.shift)
        positions[:] = np.arange(k + 1, n)
        targets[:] = x[1:n - k]
        weights[:] = 1
    elif data.task == "reverse":
        positions[:] = np.arange(1, n)
        targets[:] = x[1:][::-1]
        weights[:] = 1
    else:
        marks = np.flatnonzero(rng.random(n) < 0.15)
        marks = marks[marks > 0][:m]
        x[marks] = MARK
        last, slot = 0, 0
        for p in marks:
            positions[slot] = p
            targets[slot] = FIRST_CONTENT + v + min(p - last - 1, int(data.max_count))
            weights[slot] = 1
            last, slot = p, slot + 1
    return {"input_ids": x.astype(np.int32), "attention_mask": np.ones(n, np.int32),
            "token_type_ids": np.zeros(n, np.int32), "masked_positions": positions,
            "masked_ids": targets, "masked_weights": weights}


def make_batch(data: Any, seed: int, stream: int, index: int, batch_size: int,
               real: int | None = None) -> dict[str, np.ndarray]:
    """Batch ``index`` of ``stream`` (0 train, 1 test): a pure function of its arguments."""
    rng = np.random.default_rng([int(seed), stream, int(data.length), index])
    rows = [make_example(data, rng) for _ in range(batch_size)]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    mask = np.ones(batch_size, bool)
    if real is not None:
        mask[real:] = False
    batch["mask"] = mask
    return batch


@dataclasses.dataclass
class SynthPipeline:
    iterator: Any
    dataset: Any
    num_examples: int
    num_batches: int | None


@register_task
class PositionSynth(MaskedLanguageModel):
    """MLM-shaped synthetic position tasks (module docstring)."""

    name = "position_synth"

    def validate(self) -> None:
        data = self.config.data
        if data.get("task") not in TASKS:
            raise ValueError(f"data.task={data.get('task')!r} is unknown: choose one of "
                             f"{', '.join(TASKS)}")
        cfg = self.model_config
        if cfg.vocab_size < vocab_size(data):
            raise ValueError(f"model.vocab_size={cfg.vocab_size} is below the task's "
                             f"{vocab_size(data)} ids: set it to {vocab_size(data)}")
        if int(data.max_seq_length) != int(data.length):
            raise ValueError("data.max_seq_length must equal data.length")

    def data_identity(self) -> dict[str, Any]:
        return {}

    def dummy_batch(self, batch_size: int) -> dict[str, np.ndarray]:
        return make_batch(self.config.data, 0, 2, 0, batch_size)

    def make_pipeline(self, split: str, batch_size: int, seed: int, train: bool,
                      shard_index: int, shard_count: int) -> SynthPipeline:
        data = self.config.data
        rows = slice(shard_index * batch_size, (shard_index + 1) * batch_size)
        if train:
            ds = grain.MapDataset.range(TRAIN_STREAMS).map(
                lambda i: {k: v[rows] for k, v in make_batch(
                    data, seed, 0, i, batch_size * shard_count).items()}).to_iter_dataset()
            return SynthPipeline(iter(ds), ds, TRAIN_STREAMS, None)
        total = int(data.num_eval)
        per_batch = batch_size * shard_count
        num_batches = -(-total // per_batch)

        def eval_batch(i: int) -> dict[str, np.ndarray]:
            real = min(per_batch, total - i * per_batch)
            b = make_batch(data, 0, 1, i, per_batch, real)   # one test set for every seed
            return {k: v[rows] for k, v in b.items()}

        ds = grain.MapDataset.range(num_batches).map(eval_batch).to_iter_dataset()
        return SynthPipeline(iter(ds), ds, total, num_batches)

    def train_flops(self) -> flops.Flops:
        cfg = self.model_config
        n = int(self.config.data.length)
        forward = flops.text_encoder_forward_flops(cfg, n) + mlm_head_flops(
            cfg, num_slots(self.config.data), n)
        return forward.scaled(flops.TRAIN_FACTOR)
