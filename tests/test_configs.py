"""Every shipped recipe builds: its config validates and its model initialises (shapes only);
paper-scale train steps trace at their full size on the 8-device mesh.

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

from posjax.data.glue import TASKS as GLUE_TASKS
from posjax.training import mesh as mesh_lib
from posjax.training import optim, state, steps
from posjax.training import run_config
from posjax.training.tasks import make_task
from configs.text_recipes import SCHEMES as RECIPE_SCHEMES

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
RECIPES = [("vit_digits.py", ""), ("vit_digits.py", "tiny"), ("vit_mnist.py", ""),
           ("vit_cifar10.py", ""), ("vit_imagenet.py", "ti16"), ("vit_imagenet.py", "b16"),
           ("vit_imagenet.py", "h14,finetune"), ("mlm_tupe_r.py", ""),
           ("mlm_deberta.py", ""), ("mlm_bert_a.py", "tiny"), ("glue_base.py", "mrpc,deberta"),
           ("glue_tiny.py", "sst2")]


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(name[:-3], CONFIGS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_config(name: str, variant: str):
    module = load_recipe(name)
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


def every_variant() -> list[tuple[str, str]]:
    """Every variant string each recipe file documents."""
    vit_imagenet = load_recipe("vit_imagenet.py")
    vit = [("vit_imagenet.py", f"{model},{mode}") for model in
           ("ti16", "s16", "s32", "b16", "b32", "l16", "l32", "h14")
           for mode in vit_imagenet.MODES]
    mlm = [(f"mlm_{scheme}.py", v) for scheme in RECIPE_SCHEMES
           for v in ("", "seq512", "tiny")]
    glue = [(f"glue_{size}.py", f"{task},{scheme}") for size in ("base", "tiny")
            for task in GLUE_TASKS for scheme in RECIPE_SCHEMES]
    single = [("vit_digits.py", ""), ("vit_digits.py", "tiny"), ("vit_mnist.py", ""),
              ("vit_cifar10.py", "")]
    return vit + mlm + glue + single


def test_every_variant_passes_the_checks_made_before_reading_data():
    """train.py's checks of the training keys, the optimizer (warm-up within num_steps, ...)
    and the batch over the mesh, for every variant of every recipe (the data's own checks
    need the datasets, absent here)."""
    failures = {}
    for name, variant in every_variant():
        try:
            config = load_config(name, variant)
            make_task(config)
            run_config.validate_training_config(config)
            mesh_lib.validate_batch(config, mesh_lib.build_mesh(config.mesh))
        except ValueError as e:
            failures[f"{name}:{variant}"] = str(e)
    assert not failures


FULL_SIZE = [("vit_imagenet.py", "b16"), ("vit_imagenet.py", "h14,finetune"),
             ("vit_imagenet.py", "ti16,cifar"), ("mlm_deberta.py", ""),
             ("mlm_tupe_r.py", "seq512"), ("glue_base.py", "mrpc,deberta")]


@pytest.mark.parametrize("name,variant", FULL_SIZE, ids=[f"{n}:{v}" for n, v in FULL_SIZE])
def test_paper_scale_train_step_traces_at_full_size(name, variant):
    """The recipe's jitted train step (its global batch, microbatches, remat and scan) lowers
    from shapes alone on the 8-device mesh: a shape or sharding mistake at the real size shows
    here, not on the pod."""
    config = load_config(name, variant)
    task = make_task(config)
    mesh = mesh_lib.build_mesh(config.mesh)
    model = task.build_model()
    tx, _ = optim.make_optimizer(config.optimizer, config.num_steps)
    abstract, shardings = state.abstract_state(task, model, tx, mesh, config.seed)
    example = task.dummy_batch(1)
    train_step = steps.make_train_step(task, model, tx, mesh, shardings, example,
                                       config.microbatches)
    batch = {k: jax.ShapeDtypeStruct((config.batch_size,) + np.shape(v)[1:], np.asarray(v).dtype,
                                     sharding=mesh_lib.batch_sharding(mesh, np.ndim(v)))
             for k, v in example.items()}
    key = jax.ShapeDtypeStruct((2,), np.uint32, sharding=mesh_lib.replicated(mesh))
    with jax.set_mesh(mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
        lowered = train_step.lower(abstract, batch, key)
    new_state, _ = lowered.out_info
    assert jax.tree.map(lambda s: s.shape, new_state.params) == \
        jax.tree.map(lambda s: s.shape, abstract.params)
