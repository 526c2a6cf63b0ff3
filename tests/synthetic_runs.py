"""A small test task and tiny configs, imported by the other training tests.

``SyntheticImages`` draws a fixed random image set (learnable: the label is the brightest
quadrant), shuffles it with the seed, forms global batches and hands each process its
contiguous rows, as the real pipelines do (tests/test_multiprocess.py runs those).
"""
from __future__ import annotations

import types

import grain
import ml_collections
import numpy as np
import pytest

from posjax import config_defaults
from posjax.training.tasks import ImageClassification, make_task, register_task

NUM_CLASSES = 4


def synthetic_split(train: bool, image_size: int, channels: int) -> dict[str, np.ndarray]:
    """Random images; the label is the brightest quadrant (learnable, deterministic)."""
    n = 96 if train else 40
    rng = np.random.default_rng(0 if train else 1)
    images = rng.normal(size=(n, image_size, image_size, channels)).astype(np.float32)
    h = image_size // 2
    quadrants = np.stack([images[:, :h, :h].mean((1, 2, 3)), images[:, :h, h:].mean((1, 2, 3)),
                          images[:, h:, :h].mean((1, 2, 3)), images[:, h:, h:].mean((1, 2, 3))], 1)
    return {"image": images, "label": np.argmax(quadrants, 1).astype(np.int32)}


def _rows(batch: dict[str, np.ndarray], start: int, size: int) -> dict[str, np.ndarray]:
    return {k: v[start:start + size] for k, v in batch.items()}


@register_task
class SyntheticImages(ImageClassification):
    """Image classification on ``synthetic_split``, process-count-invariant global batches."""

    name = "synthetic_images"

    def validate(self) -> None:
        cfg = self.model_config
        if cfg.num_classes != NUM_CLASSES:
            raise ValueError(f"model.num_classes={cfg.num_classes}: synthetic_images has "
                             f"{NUM_CLASSES} classes")

    def make_pipeline(self, split, batch_size, seed, train, shard_index, shard_count):
        cfg = self.model_config
        data = synthetic_split(train, cfg.image_size[0], cfg.num_channels)
        n = len(data["label"])
        examples = [{"image": data["image"][i], "label": data["label"][i],
                     "mask": np.bool_(True)} for i in range(n)]
        global_batch = batch_size * shard_count
        ds = grain.MapDataset.source(examples)
        num_batches = None
        if train:
            ds = ds.shuffle(seed=seed).repeat()
        else:
            padded = -(-n // global_batch) * global_batch
            pad = {"image": examples[0]["image"], "label": np.int32(0), "mask": np.bool_(False)}
            ds = grain.MapDataset.source(examples + [pad] * (padded - n))
            num_batches = padded // global_batch
        ds = ds.batch(global_batch, drop_remainder=True)
        start = shard_index * batch_size
        ds = ds.map(lambda b: _rows(b, start, batch_size))
        ds = ds.to_iter_dataset()
        return types.SimpleNamespace(iterator=iter(ds), dataset=ds, num_examples=n,
                                     num_batches=num_batches)


def tiny_config(**overrides) -> ml_collections.ConfigDict:
    """A 1-layer ViT (hidden 16) on 8x8 synthetic images; 6 steps, checkpoints every 2."""
    config = config_defaults.default_config()
    config.task = "synthetic_images"
    config.model = dict(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                        num_heads=2, num_layers=1, mlp_dim=32, num_classes=NUM_CLASSES,
                        dropout_rate=0.1)
    config.num_steps = 6
    config.batch_size = 16
    config.log_every_steps = 1
    config.optimizer.update(learning_rate=1e-2, warmup_steps=1, weight_decay=0.1,
                            grad_clip_norm=1.0)
    config.checkpoint.update(every_steps=2, keep=0)
    config.peak_flops = 1e12   # skips measuring the CPU's peak (seconds on a busy machine)
    for key, value in overrides.items():
        node = config
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return config


def test_synthetic_batches_do_not_depend_on_process_count():
    task = make_task(tiny_config())
    whole = next(task.make_pipeline("train", 16, 0, True, 0, 1).iterator)
    halves = [next(task.make_pipeline("train", 8, 0, True, i, 2).iterator) for i in range(2)]
    for k in whole:
        np.testing.assert_array_equal(whole[k], np.concatenate([h[k] for h in halves]))
    with pytest.raises(ValueError, match="num_classes"):
        make_task(tiny_config(**{"model.num_classes": 3})).validate()
