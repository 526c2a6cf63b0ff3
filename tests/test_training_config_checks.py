"""Configs and data that a run refuses before it writes anything, the keys a resume may
change, and how the test split is opened."""
from __future__ import annotations

import math
import pathlib
import sys

import numpy as np
import pytest

from posjax import config_defaults
from posjax.training import evaluator
from posjax.training import metrics
from posjax.training import run_config
from posjax.training import run_setup
from posjax.training import trainer

import synthetic_runs as syn


@pytest.mark.parametrize("overrides,match", [
    ({"mesh.data": 3}, "needs 3 devices but 8 are present"),
    ({"batch_size": 12}, "batch_size=12 is not divisible"),
    ({"microbatches": 3}, "microbatches=3"),
    ({"eval_batch_size": 4}, "eval_batch_size=4 is not divisible"),
    ({"model.num_heads": 3}, "^model.hidden_size=16 is not valid"),
    ({"model.colour": 1}, "unknown ViTConfig field"),
    ({"task": "translation"}, "config.task='translation'"),
    ({"init_from": "/nonexistent/export"}, "init_from='/nonexistent/export'"),
    ({"optimizer.beta1": 0.9}, "unknown config key.*'optimizer.beta1'"),
    ({"num_epochs": 3}, "unknown config key.*'num_epochs'"),
    ({"peak_flops": math.inf}, r"peak_flops=inf is not valid: must be a finite number >= 0"),
    ({"optimizer.grad_clip_norm": math.nan}, "optimizer.grad_clip_norm=nan is not valid"),
])
def test_bad_config_is_refused_before_anything_runs(tmp_path, overrides, match):
    config = syn.tiny_config()
    with config.unlocked():
        config.update_from_flattened_dict(overrides)
    with pytest.raises(ValueError, match=match):
        trainer.train(config, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_missing_dataset_path_is_refused(tmp_path):
    from posjax.data import default_data_config
    config = config_defaults.default_config()
    config.data = default_data_config("mnist")
    config.data.path = str(tmp_path / "no_mnist_here")
    config.model = dict(image_size=28, patch_size=7, num_channels=1, hidden_size=16,
                        num_heads=2, num_layers=1, mlp_dim=32, num_classes=10)
    with pytest.raises(ValueError, match="data.path="):
        trainer.train(config, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_data_that_does_not_fit_the_model_is_refused_before_writing(tmp_path):
    """digits has 10 classes of 1-channel images: another model.num_classes or num_channels
    is one ValueError naming the field and the fix, before the workdir is created."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "configs"))
    import vit_digits
    for field, value, match in (
            ("num_classes", 5, "model.num_classes=5 but digits has 10 classes: set "
                               "--config.model.num_classes=10"),
            ("num_channels", 3, "model.num_channels=3 but digits images have 1 channel: set "
                                "--config.model.num_channels=1")):
        config = vit_digits.get_config("tiny")
        config.model[field] = value
        with pytest.raises(ValueError, match=match):
            trainer.train(config, tmp_path / "w")
        assert not (tmp_path / "w").exists()


def test_a_bad_test_split_is_refused_before_writing(tmp_path):
    """The test split is opened before anything is written, like the train split: an empty
    or unreadable one used to end the run at its first evaluation, after its steps and saves."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "configs"))
    import vit_digits
    config = vit_digits.get_config("tiny")
    config.data.test_split = "test[5:5]"
    with pytest.raises(ValueError, match=r"data.test_split selects 0 examples"):
        trainer.train(config, tmp_path / "w")
    assert not (tmp_path / "w").exists()
    folder = tmp_path / "npz"
    folder.mkdir()
    for split in ("train", "test"):
        np.savez(folder / f"{split}.npz", image=np.zeros((8, 8, 8, 1), np.uint8),
                 label=np.arange(8) % 10)
    (folder / "test.npz").write_bytes((folder / "test.npz").read_bytes()[:-30])   # cut short
    config = vit_digits.get_config("tiny")
    config.data.update(name="cifar10", path=str(folder), train_split="train", test_split="test")
    config.model.num_classes = 8
    with pytest.raises(ValueError, match=rf"{folder / 'test.npz'}: cannot be read as an npz"):
        trainer.train(config, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_the_test_split_is_read_once_per_run(tmp_path, monkeypatch):
    """Opened before anything is written, then each evaluation is a fresh pass over it (MLM
    packs its whole test split when opened: that was done again at every evaluation)."""
    opened = []
    make = run_setup.Run.make_eval_pipeline
    monkeypatch.setattr(run_setup.Run, "make_eval_pipeline",
                        lambda self: (opened.append(1), make(self))[1])
    config = syn.tiny_config(**{"num_steps": 4, "eval_every_steps": 1})
    result = trainer.train(config, tmp_path / "w")
    evals = [r for r in metrics.read_metrics(tmp_path / "w" / "metrics.jsonl")
             if r["split"] == "eval"]
    assert opened == [1] and [r["step"] for r in evals] == [1, 2, 3, 4]
    assert evals[-1]["num_examples"] == result.eval["num_examples"] > 0
    assert evaluator.evaluate(config, tmp_path / "w") == {"step": 4, "split": "test", **result.eval}


def test_operational_keys_may_change_on_resume():
    a = config_defaults.config_dict(syn.tiny_config())
    b = config_defaults.config_dict(syn.tiny_config(**{"mesh.data": 2, "checkpoint.every_steps": 5,
                                            "log_every_steps": 3, "eval_batch_size": 8}))
    assert run_config.config_differences(a, b) == []
