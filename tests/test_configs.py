"""Every shipped recipe builds: its config validates and its model initialises (shapes only).

Paper-scale recipes (ViT-Ti…H, text base) scan over layers; their abstract init must carry
the stacked parameter layout the converters and init_from restack to.
"""
from __future__ import annotations

import importlib.util
import pathlib

import flax.linen as nn
import jax
import numpy as np
import pytest

from posjax.training.tasks import make_task

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
RECIPES = [("vit_digits.py", ""), ("vit_digits.py", "tiny"), ("vit_mnist.py", ""),
           ("vit_cifar10.py", ""), ("vit_imagenet.py", "ti16"), ("vit_imagenet.py", "b16"),
           ("vit_imagenet.py", "h14,finetune"), ("mlm_tupe_r.py", ""),
           ("mlm_deberta.py", ""), ("mlm_bert_a.py", "tiny"), ("glue_base.py", "mrpc,deberta"),
           ("glue_tiny.py", "sst2")]


def load_config(name: str, variant: str):
    spec = importlib.util.spec_from_file_location(name[:-3], CONFIGS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()


@pytest.mark.parametrize("name,variant", RECIPES, ids=[f"{n}:{v}" for n, v in RECIPES])
def test_recipe_model_initialises(name, variant):
    config = load_config(name, variant)
    task = make_task(config)
    model = task.build_model()
    batch = {k: np.asarray(v) for k, v in task.dummy_batch(1).items()}
    params = jax.eval_shape(lambda: task.init_params(model, jax.random.key(0), batch))
    encoder = nn.meta.unbox(params)
    while "encoder" in encoder:   # text task models nest encoder/encoder
        encoder = encoder["encoder"]
    scanned = task.model_config.scan_layers
    assert ("layers" in encoder) == scanned
    if scanned:
        leaf = jax.tree.leaves(encoder["layers"])[0]
        assert leaf.shape[0] == task.model_config.num_layers
    else:
        assert f"layer_{task.model_config.num_layers - 1}" in encoder
