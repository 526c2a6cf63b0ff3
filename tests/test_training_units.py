"""Pieces of the training system: FLOP count, optimizer, mesh/batch/workdir validation, metrics."""
from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax.models.config import ViTConfig
from posjax.models.vit import ViT
from posjax.training import checkpoint as ckpt_lib
from posjax import config_defaults
from posjax.training import errors as errors_lib
from posjax.training import evaluator
from posjax.training import flops, metrics, optim, peak_flops
from posjax.training import mesh as mesh_lib
from posjax.training import results as results_lib
from posjax.training import run_config
from posjax.training import run_setup
from posjax.training import trainer
from posjax.training import workdir as workdir_lib
from posjax.training import init_from_checks
from posjax.training import init_from as init_from_lib
from posjax.training import state as state_lib
from posjax.training import stop_request

import test_training_synthetic as syn
from model_inputs import every_eqn


# ----------------------------------------------------------------------------- FLOPs


def _matmul_flops(jaxpr) -> float:
    """2·MACs of every dot_general and convolution in a jaxpr (recursing into sub-jaxprs)."""
    total = 0.0
    for eqn in every_eqn(jaxpr):
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            batch = math.prod(lhs[i] for i in lb)
            contract = math.prod(lhs[i] for i in lc)
            free_l = math.prod(s for i, s in enumerate(lhs) if i not in lc and i not in lb)
            free_r = math.prod(s for i, s in enumerate(rhs) if i not in rc and i not in rb)
            total += 2.0 * batch * contract * free_l * free_r
        elif name == "conv_general_dilated":
            out = eqn.outvars[0].aval.shape
            kernel = eqn.invars[1].aval.shape            # HWIO as Flax lays it out
            total += 2.0 * math.prod(out) * math.prod(kernel[:-1])
    return total


@pytest.mark.parametrize("overrides", [
    {},
    {"pooling": "map", "representation_size": 24},
    {"position_scheme": "tupe_r", "pooling": "gap"},
    {"position_scheme": "deberta", "pooling": "gap"},
    {"resnet_layers": (1, 1), "patch_size": 1, "image_size": 32},
    {"position_scheme": "tupe_r"},
    # A one-row grid: both axes' indices are Toeplitz, but only text takes the relative shift.
    {"position_scheme": "deberta", "pooling": "gap", "image_size": (4, 16), "gather": "skew"},
    {"position_scheme": "deberta", "pooling": "first"},
    {"position_scheme": "bert_abs_d"},
    {"position_scheme": "bert_abs_d", "pooling": "gap"},
], ids=["vit", "map_prelogits", "tupe_r", "deberta", "hybrid", "tupe_r_token",
        "deberta_one_row_grid", "deberta_first_patch", "bert_abs_d_token", "bert_abs_d_gap"])
def test_analytic_flops_equal_the_traced_matmuls(overrides):
    """A batch of 3 images: B · per_example + per_step equals the traced model's matmuls (the
    position tables of TUPE and DeBERTa are computed once per batch, not per image)."""
    cfg = ViTConfig(**{"image_size": 16, "patch_size": 4, "num_channels": 3, "hidden_size": 32,
                       "num_heads": 4, "num_layers": 2, "mlp_dim": 64, "num_classes": 7,
                       "resnet_width": 32, **overrides})
    model = ViT(cfg)
    images = jnp.zeros((3, *cfg.image_size, 3))
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), images)
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, images))(params)
    forward = flops.vit_forward_flops(cfg)
    assert forward.total(3) == pytest.approx(_matmul_flops(jaxpr.jaxpr), rel=1e-9)
    assert (forward.per_step > 0) == (cfg.position_scheme != "vit")
    train = flops.vit_train_flops(cfg)
    assert train.per_step == 3 * forward.per_step
    assert train.per_example < 3 * forward.per_example     # no gradient for the pixels


def test_train_flops_equal_the_traced_gradient_matmuls():
    """Forward + backward of a ViT: every product three times, except the pixels' gradient.
    (Not the hybrid: the dx of its strided convolutions is traced as a dilated convolution
    whose count includes the inserted zeros.)"""
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_heads=4,
                    num_layers=2, mlp_dim=64, num_classes=7)
    model = ViT(cfg)
    images = jnp.zeros((3, *cfg.image_size, 3))
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), images)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(model.apply(p, images))))(params)
    assert flops.vit_train_flops(cfg).total(3) == pytest.approx(_matmul_flops(jaxpr.jaxpr),
                                                                rel=1e-9)


@pytest.mark.parametrize("overrides", [
    {"position_scheme": "bert_abs"},
    {"position_scheme": "tupe_r"},
    {"position_scheme": "bert_abs_d"},
    {"position_scheme": "deberta_v2", "max_relative_positions": 16, "position_buckets": 4,
     "share_att_key": True, "conv_kernel_size": 3},
    {"position_scheme": "deberta", "max_relative_positions": 4},
    # 2T − 1 = 23 distances <= R table rows: ``shift`` multiplies only those 23 rows.
    {"position_scheme": "deberta_v2", "max_relative_positions": 32, "position_buckets": 16},
    {"position_scheme": "deberta", "max_relative_positions": 16},
    {"position_scheme": "deberta_v2", "max_relative_positions": 32, "position_buckets": 16,
     "gather": "take"},
    # 23 distances > R = 8 rows: ``skew`` still multiplies the 23 rows (``shift`` the 8).
    {"position_scheme": "deberta_v2", "max_relative_positions": 16, "position_buckets": 4,
     "gather": "skew"},
    {"position_scheme": "deberta", "max_relative_positions": 4, "gather": "skew"},
], ids=["bert_abs", "tupe_r", "bert_abs_d", "deberta_v2_conv", "deberta_v1", "deberta_v2_shift_short",
        "deberta_v1_shift_short", "deberta_v2_take_short", "deberta_v2_skew_long",
        "deberta_v1_skew_long"])
def test_classifier_flops_equal_the_traced_matmuls(overrides):
    """[CLS] classifiers (the last layer computes token 0 alone): 3 sequences of 12 tokens."""
    from posjax.models.config import TextConfig
    from posjax.models.text import TextForSequenceClassification
    cfg = TextConfig(**{"vocab_size": 32, "hidden_size": 32, "num_heads": 4, "num_layers": 2,
                        "mlp_dim": 64, "max_position_embeddings": 16, **overrides})
    model = TextForSequenceClassification(cfg, num_labels=3)
    ids = jnp.ones((3, 12), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), ids, ids)
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, ids, ids))(params)
    head = flops.Flops(per_example=2.0 * 32 * 32 + 2.0 * 32 * 3)
    forward = flops.text_encoder_forward_flops(cfg, 12, first_only=True) + head
    assert forward.total(3) == pytest.approx(_matmul_flops(jaxpr.jaxpr), rel=1e-9)
    assert forward.total(3) < (flops.text_encoder_forward_flops(cfg, 12) + head).total(3)


@pytest.mark.parametrize("gather", ["take", "shift", "skew"])
@pytest.mark.parametrize("span", [4, 64])      # R = 8 < 2T − 1 = 95 < R = 128
def test_emd_mlm_flops_equal_the_traced_matmuls(gather, span):
    """DeBERTa MLM with the enhanced mask decoder, 3 sequences of 48 tokens, 6 masked slots:
    the EMD's position products use all R rows whatever the gather (a per-example index)."""
    from posjax.models.config import TextConfig
    from posjax.models.text import TextForMaskedLM
    from posjax.training.text_tasks import mlm_head_flops
    cfg = TextConfig(position_scheme="deberta_v2", vocab_size=32, hidden_size=32, num_heads=4,
                     num_layers=2, mlp_dim=64, max_position_embeddings=64,
                     max_relative_positions=span, use_emd=True, position_biased_input=False,
                     gather=gather)
    model = TextForMaskedLM(cfg)
    ids, masked = jnp.ones((3, 48), jnp.int32), jnp.zeros((3, 6), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), ids, ids, masked_positions=masked)
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, ids, ids, masked_positions=masked))(params)
    forward = flops.text_encoder_forward_flops(cfg, 48) + mlm_head_flops(cfg, 6, 48)
    assert forward.total(3) == pytest.approx(_matmul_flops(jaxpr.jaxpr), rel=1e-9)


def test_position_flops_per_step_and_per_example_by_hand():
    """DeBERTa v2, H=8, MLP 16, 2 layers, k=4 buckets (R=8 rows), c2p+p2c, T=6 tokens;
    TUPE-A on the same sizes (a (T+1)-row table)."""
    from posjax.models.config import TextConfig
    base = dict(vocab_size=32, hidden_size=8, num_heads=2, num_layers=2, mlp_dim=16,
                max_position_embeddings=16)
    deberta = TextConfig(**base, position_scheme="deberta_v2", max_relative_positions=8,
                         position_buckets=4)
    layer = 2 * 6 * 8 * 4 * 8 + 2 * 2 * 6 * 6 * 8 + 2 * 6 * 2 * 8 * 16       # 7296
    per_example = 2 * layer + 2 * 2 * (2 * 6 * 8 * 8)     # + layers x terms x 2·T·R·H
    per_step = 2 * 2 * (2 * 8 * 8 * 8)                    # layers x terms x 2·R·H²
    assert flops.position_flops(deberta, 6) == flops.Flops(2 * 2 * 2 * 6 * 8 * 8, per_step)
    assert flops.text_encoder_forward_flops(deberta, 6) == flops.Flops(per_example, per_step)
    assert flops.Flops(per_example, per_step).total(32) == 32 * per_example + per_step
    tupe = TextConfig(**base, position_scheme="tupe_a")
    assert flops.text_encoder_forward_flops(tupe, 6) == flops.Flops(
        2 * layer, 2 * 2 * 7 * 8 * 8 + 2 * 7 * 7 * 8)
    # BERT-A-d: TUPE's part, the mixed terms' position sides on T rows (per step), and per
    # layer the word sides 2·2T·H² and the two products 2·2·T·T·H (per example).
    four_terms = TextConfig(**base, position_scheme="bert_abs_d")
    mixed = 2 * 12 * 8 * 8 + 2 * 2 * 6 * 6 * 8                                   # 2688
    assert flops.text_encoder_forward_flops(four_terms, 6) == flops.Flops(
        2 * layer + 2 * mixed, 2 * 2 * 7 * 8 * 8 + 2 * 7 * 7 * 8 + 2 * 2 * 6 * 8 * 8)


def test_vit_b16_flops_match_the_published_count():
    # ViT-B/16 at 224: 17.6 GMACs forward (e.g. timm / fvcore tables), every token of every
    # layer; ours skips the last layer's 196 patch rows (the head reads [CLS] only).
    cfg = ViTConfig()
    skipped = (flops.attention_layer_flops(197, 768, 3072)
               - flops.attention_layer_flops(197, 768, 3072, queries=1))
    ours = flops.vit_forward_flops(cfg).total(1)
    assert (ours + skipped) / 2 / 1e9 == pytest.approx(17.56, abs=0.05)
    assert ours / 2 / 1e9 == pytest.approx(16.35, abs=0.01)


# ----------------------------------------------------------------------------- optimizer


def _opt(**kw):
    return {**config_defaults.default_config().optimizer.to_dict(), **kw}


def test_schedule_warmup_then_cosine_and_linear():
    s = optim.learning_rate_schedule(_opt(learning_rate=1.0, warmup_steps=10,
                                          schedule="cosine", end_learning_rate=0.1), 110)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0)
    assert float(s(60)) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-6)
    assert float(s(110)) == pytest.approx(0.1, abs=1e-6)
    lin = optim.learning_rate_schedule(_opt(learning_rate=2.0, schedule="linear"), 100)
    assert float(lin(50)) == pytest.approx(1.0)


def test_weight_decay_skips_biases_and_norms():
    params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)},
              "norm": {"scale": jnp.ones(2), "bias": jnp.ones(2)}, "pos_embedding": jnp.ones(3)}
    mask = optim.decay_mask(params)
    assert mask == {"dense": {"kernel": True, "bias": False},
                    "norm": {"scale": False, "bias": False}, "pos_embedding": True}
    tx, _ = optim.make_optimizer(_opt(name="adamw", learning_rate=0.1, weight_decay=0.5,
                                      schedule="constant"), 10)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    assert float(updates["dense"]["kernel"][0, 0]) == pytest.approx(-0.1 * 0.5)
    assert float(updates["dense"]["bias"][0]) == 0.0 and float(updates["norm"]["scale"][0]) == 0


def test_sgd_momentum_and_clipping():
    tx, _ = optim.make_optimizer(_opt(name="sgd", learning_rate=1.0, momentum=0.9,
                                      schedule="constant", grad_clip_norm=1.0), 10)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    grads = {"w": jnp.array([3.0, 4.0])}     # norm 5 -> clipped to norm 1
    u1, state = tx.update(grads, state, params)
    u2, _ = tx.update(grads, state, params)
    np.testing.assert_allclose(u1["w"], [-0.6, -0.8], rtol=1e-6)
    np.testing.assert_allclose(u2["w"], [-0.6 * 1.9, -0.8 * 1.9], rtol=1e-6)


@pytest.mark.parametrize("field,value,match", [
    ("name", "lamb", "optimizer.name='lamb'"),
    ("warmup_steps", 10, "optimizer.warmup_steps=10"),
    ("learning_rate", 0.0, "optimizer.learning_rate=0.0"),
    ("b1", 1.0, r"optimizer.b1=1.0 is not valid: must lie in \[0, 1\)"),
    ("b2", 1.5, r"optimizer.b2=1.5 is not valid: must lie in \[0, 1\)"),
    ("eps", 0.0, "optimizer.eps=0.0 is not valid: must be > 0"),
    ("nesterov", True, "optimizer.nesterov=True is not valid: needs momentum > 0"),
    ("grad_clip_norm", math.nan, "optimizer.grad_clip_norm=nan is not valid: must be a finite"),
    ("weight_decay", math.nan, "optimizer.weight_decay=nan is not valid: must be a finite"),
    ("learning_rate", math.inf, "optimizer.learning_rate=inf is not valid: must be a finite"),
    ("end_learning_rate", math.nan, "optimizer.end_learning_rate=nan is not valid: must be a "),
    ("eps", math.inf, "optimizer.eps=inf is not valid: must be a finite"),
])
def test_bad_optimizer_config(field, value, match):
    name = "sgd" if field == "nesterov" else "adamw"
    with pytest.raises(ValueError, match=match):
        optim.validate(_opt(**{"name": name, "momentum": 0.0, field: value}), 10)


# ----------------------------------------------------------------------------- mesh & batch


def test_mesh_shape_resolution_and_errors():
    assert mesh_lib.mesh_shape({"data": -1, "fsdp": 2, "tensor": 1}, 8) == (4, 2, 1)
    with pytest.raises(ValueError, match="needs 4 devices but 8 are present"):
        mesh_lib.mesh_shape({"data": 2, "fsdp": 2, "tensor": 1}, 8)
    with pytest.raises(ValueError, match="does not divide 8"):
        mesh_lib.mesh_shape({"data": -1, "fsdp": 3, "tensor": 1}, 8)
    with pytest.raises(ValueError, match="unknown axes"):
        mesh_lib.mesh_shape({"pipeline": 2}, 8)
    mesh = mesh_lib.build_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_shardings_drop_axes_that_do_not_divide():
    mesh = mesh_lib.build_mesh({"fsdp": 2, "tensor": 4})
    spec = mesh_lib._fit_spec(jax.sharding.PartitionSpec("fsdp", "tensor"), (16, 10), mesh, "x")
    assert spec == jax.sharding.PartitionSpec("fsdp", None)


def test_logical_shardings_inside_the_logical_axis_rules():
    """The shardings of a boxed abstract tree are the same whether or not the caller is
    already inside ``nn.logical_axis_rules`` (where nn.unbox would add a constraint)."""
    import flax.linen as nn
    mesh = mesh_lib.build_mesh({"fsdp": 2, "tensor": 4})
    model = ViT(ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                          num_heads=4, num_layers=1, mlp_dim=32, num_classes=3))
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((2, 8, 8, 1)))
    outside = mesh_lib.logical_shardings(boxed, mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
        inside = mesh_lib.logical_shardings(boxed, mesh)
    assert jax.tree.leaves(inside) == jax.tree.leaves(outside)
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(inside))


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


def test_workdir_checks(tmp_path):
    config = syn.tiny_config()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        trainer.train(config, a_file / "run")
    with pytest.raises(ValueError, match="not writable"):
        trainer.train(config, "/proc/posjax_run")
    # A workdir with another config's checkpointed run is refused and left as it was.
    workdir = tmp_path / "other"
    (workdir / "checkpoints" / "4").mkdir(parents=True)     # a finalized step directory
    other = syn.tiny_config(**{"model.hidden_size": 32, "num_steps": 9, "mesh.data": 2})
    saved = json.dumps(config_defaults.config_dict(other))
    (workdir / config_defaults.CONFIG_FILE).write_text(saved)
    with pytest.raises(ValueError, match=r"another config(.|\n)*model.hidden_size: 32 -> 16"
                                         r"(.|\n)*num_steps: 9 -> 6"):
        trainer.train(config, workdir)
    assert (workdir / config_defaults.CONFIG_FILE).read_text() == saved
    assert sorted(p.name for p in workdir.iterdir()) == ["checkpoints", config_defaults.CONFIG_FILE]


def _checkpointed_workdir(path, config):
    """A workdir as a run of ``config`` leaves it after its first checkpoint (step 2)."""
    (path / "checkpoints" / "2").mkdir(parents=True)
    (path / config_defaults.CONFIG_FILE).write_text(json.dumps(config_defaults.config_dict(config)))
    return path


def test_a_run_without_checkpoints_does_not_block_a_corrected_rerun(tmp_path):
    """A config.json left by a run that failed before its first checkpoint (another config,
    or a damaged file) is replaced: nothing depends on it yet."""
    config = syn.tiny_config()
    for text in (json.dumps(config_defaults.config_dict(syn.tiny_config(**{"model.num_channels": 3}))),
                 ""):
        (tmp_path / config_defaults.CONFIG_FILE).write_text(text)
        (tmp_path / "checkpoints").mkdir(exist_ok=True)       # created, nothing saved
        workdir_lib.check_workdir(tmp_path, config)
        assert workdir_lib.config_to_save(tmp_path, config) == config_defaults.config_dict(config)


@pytest.mark.parametrize("make, message", [
    (lambda w: (w / "metrics.jsonl").mkdir(), "metrics.jsonl is a directory, not a file: move it "
                                             "out of the workdir"),
    (lambda w: (w / "loss_curve.png").mkdir(), "loss_curve.png is a directory, not a file"),
    (lambda w: (w / config_defaults.CONFIG_FILE).mkdir(), "config.json is a directory, not a file"),
    (lambda w: (w / "tensorboard").write_text(""), "tensorboard is a file, not a directory"),
    (lambda w: (w / "checkpoints").symlink_to(w / "volume"),
     r"checkpoints is a symbolic link to '.*/volume', which does not exist \(storage not "
     r"mounted\?\): mount it, or remove the link"),
])
def test_workdir_entries_of_the_wrong_kind_are_refused_before_anything_runs(tmp_path, make,
                                                                           message):
    """Each was a traceback, some only after all the steps (loss_curve.png at the very end)."""
    workdir = tmp_path / "w"
    workdir.mkdir()
    make(workdir)
    with pytest.raises(ValueError, match=rf"^workdir '{workdir}': {message}"):
        trainer.train(syn.tiny_config(), workdir)


def test_a_workdir_under_a_file_is_refused_before_anything_runs(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match=rf"^workdir '{afile / 'w'}': '{afile}' is a file, not "
                                         "a directory; choose another workdir$"):
        trainer.train(syn.tiny_config(), afile / "w")


def test_eval_refuses_checkpoints_it_could_not_write_its_metrics_beside(tmp_path):
    workdir = _checkpointed_workdir(tmp_path, syn.tiny_config())
    (workdir / "predictions").write_text("")
    with pytest.raises(ValueError, match=f"^workdir '{workdir}': predictions is a file"):
        run_setup.prepare(syn.tiny_config(), workdir, training=False)


def test_a_fresh_start_replaces_nothing_it_should_not(tmp_path):
    """Without checkpoints a run starts from step 0 and rewrites config.json and metrics.jsonl:
    refused when config.json is another program's, or the metrics show a run that must have
    saved checkpoints (lost, or on storage that is not mounted); a run that stopped before or
    just after its first save (async) starts over."""
    config = syn.tiny_config()   # checkpoint.every_steps = 2
    (tmp_path / config_defaults.CONFIG_FILE).write_text('{"model_type": "deberta-v2", "vocab_size": 9}')
    with pytest.raises(ValueError, match=r"its config.json is not a posjax run's \(keys "
                                         r"\['model_type', 'vocab_size'\]\); refusing"):
        workdir_lib.check_workdir(tmp_path, config)
    (tmp_path / config_defaults.CONFIG_FILE).write_text(json.dumps(config_defaults.config_dict(config)))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "split": "train", "loss": 1.0}) + "\n"
                               for s in range(1, 5)))
    workdir_lib.check_workdir(tmp_path, config)   # step 4 = 2 x every_steps: the save may be pending
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 5, "split": "train", "loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match=r"has metrics up to step 5 but no checkpoint in .*"
                                         r"checkpoints \(checkpoint.every_steps=2\): if the "
                                         r"checkpoints are elsewhere"):
        workdir_lib.check_workdir(tmp_path, config)
    # The interval the metrics were written with is the saved run's, not this command's.
    saved_every_step = syn.tiny_config(**{"checkpoint.every_steps": 1})
    (tmp_path / config_defaults.CONFIG_FILE).write_text(json.dumps(config_defaults.config_dict(saved_every_step)))
    metrics.write_text("".join(json.dumps({"step": s, "split": "train", "loss": 1.0}) + "\n"
                               for s in range(1, 4)))
    with pytest.raises(ValueError, match=r"up to step 3 .*\(checkpoint.every_steps=1\)"):
        workdir_lib.check_workdir(tmp_path, config)


def test_damaged_config_json_is_named_with_the_fix(tmp_path):
    workdir = _checkpointed_workdir(tmp_path, syn.tiny_config())
    (workdir / config_defaults.CONFIG_FILE).write_text("")
    message = f"{workdir / config_defaults.CONFIG_FILE} is damaged.*restore it from a copy"
    with pytest.raises(ValueError, match=message):
        workdir_lib.check_workdir(workdir, syn.tiny_config())
    with pytest.raises(ValueError, match=message):
        config_defaults.load_saved_config(workdir)
    (workdir / config_defaults.CONFIG_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match="damaged \\(not a JSON object\\)"):
        workdir_lib.check_workdir(workdir, syn.tiny_config())


def test_saved_config_of_another_program_or_an_older_run(tmp_path):
    """configs/saved.py (eval.py's default) refuses another program's config.json in one
    error, and fills a key an older run's config.json lacks with today's default."""
    path = tmp_path / config_defaults.CONFIG_FILE
    path.write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    with pytest.raises(ValueError, match=r"is not a posjax run's config \(keys \['architec"):
        config_defaults.load_saved_config(tmp_path)
    old = config_defaults.config_dict(syn.tiny_config())
    del old["eval_batch_size"], old["distributed"], old["checkpoint"]["async_save"]
    path.write_text(json.dumps(old))
    loaded = config_defaults.load_saved_config(tmp_path)
    assert loaded.eval_batch_size == 0 and loaded.distributed.enabled is False
    assert loaded.checkpoint.async_save is True and loaded.checkpoint.every_steps == 2
    assert config_defaults.config_dict(loaded) == config_defaults.config_dict(syn.tiny_config())


def test_every_text_model_field_can_be_overridden_and_old_runs_still_resume(tmp_path):
    """Text recipes list every TextConfig field (--config.model.remat=True works). A run saved
    when they listed only the fields they set resumes and evaluates with the recipe, also with
    another remat or gather (how the same model is computed); a real model change is still
    refused."""
    from configs.text_recipes import mlm_config
    config = mlm_config("deberta", "tiny")
    assert {"remat", "scan_layers", "gather"} <= set(config.model)
    workdir = _checkpointed_workdir(tmp_path, config)
    saved = json.loads((workdir / config_defaults.CONFIG_FILE).read_text())
    recipe_set = {"position_scheme", "vocab_size", "hidden_size", "num_heads", "num_layers",
                  "mlp_dim", "max_position_embeddings", "type_vocab_size", "hidden_act",
                  "layer_norm_eps", "dropout_rate", "attention_dropout_rate", "use_emd",
                  "position_biased_input", "max_relative_positions", "pos_att_type"}
    saved["model"] = {k: v for k, v in saved["model"].items() if k in recipe_set}
    (workdir / config_defaults.CONFIG_FILE).write_text(json.dumps(saved))
    workdir_lib.check_workdir(workdir, config)
    workdir_lib.check_eval_config(workdir, config)
    computed_otherwise = config.copy_and_resolve_references()
    computed_otherwise.model.remat = True
    computed_otherwise.model.gather = "skew"
    workdir_lib.check_workdir(workdir, computed_otherwise)
    workdir_lib.check_eval_config(workdir, computed_otherwise)
    changed = config.copy_and_resolve_references()
    changed.model.scan_layers = True            # another parameter layout
    with pytest.raises(ValueError, match="another config(.|\n)*model.scan_layers: False -> True"):
        workdir_lib.check_workdir(workdir, changed)
    with pytest.raises(ValueError, match="model.scan_layers: False -> True"):
        workdir_lib.check_eval_config(workdir, changed)


def test_write_json_replaces_the_file_whole_or_not_at_all(tmp_path):
    path = tmp_path / "config.json"
    workdir_lib.write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        workdir_lib.write_json(path, {"a": object()})          # fails half-way through encoding
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]   # no temp file left


def test_worker_count_change_is_refused_on_resume(tmp_path):
    """Grain saves another iterator state with worker processes than without, so resuming
    with another data.worker_count is refused up front (not a KeyError inside Grain)."""
    from posjax.data import default_data_config
    config = syn.tiny_config()
    config.data = default_data_config("digits")
    workdir = _checkpointed_workdir(tmp_path, config)
    changed = config.copy_and_resolve_references()
    changed.data.worker_count = 2
    with pytest.raises(ValueError, match="another config(.|\n)*data.worker_count: 0 -> 2"):
        workdir_lib.check_workdir(workdir, changed)


def test_init_from_with_an_empty_params_folder_is_one_error(tmp_path):
    (tmp_path / "params").mkdir()          # a converter folder whose save never happened
    with pytest.raises(ValueError, match=r"^init_from='.*': .*params: cannot read this "
                                         r"checkpoint \(FileNotFoundError: "):
        init_from_checks.check_init_from(tmp_path, {})


def test_init_from_is_read_only_by_a_fresh_start(tmp_path):
    """A resumed run (or an evaluation) never reads init_from: it may be gone or changed;
    config.json keeps where the run's weights came from."""
    gone = str(tmp_path / "export_deleted_since")
    config = syn.tiny_config(init_from=gone)
    with pytest.raises(ValueError, match="init_from="):
        run_setup.prepare(config, tmp_path / "fresh", training=True)
    workdir = _checkpointed_workdir(tmp_path / "run", config)
    run_setup.prepare(config, workdir, training=True)
    run_setup.prepare(config, workdir, training=False)
    elsewhere = syn.tiny_config(init_from=str(tmp_path / "another_export"))
    run_setup.prepare(elsewhere, workdir, training=True)
    assert workdir_lib.config_to_save(workdir, elsewhere)["init_from"] == gone


def test_eval_may_change_only_how_it_reads_the_data(tmp_path):
    config = syn.tiny_config()
    workdir = _checkpointed_workdir(tmp_path, config)
    allowed = syn.tiny_config(**{"mesh.data": 1, "mesh.fsdp": 8, "eval_batch_size": 8,
                                 "batch_size": 8, "init_from": "/elsewhere"})
    with allowed.unlocked():
        allowed.data = {"test_split": "train[:10%]", "path": "/moved"}
    workdir_lib.check_eval_config(workdir, allowed)
    changed = syn.tiny_config(**{"model.hidden_size": 32, "optimizer.name": "sgd"})
    with pytest.raises(ValueError, match=r"model or its checkpointed state:\n"
                                         r"  model.hidden_size: 16 -> 32\n"
                                         r"  optimizer.name: 'adamw' -> 'sgd'\n"):
        workdir_lib.check_eval_config(workdir, changed)


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


def test_init_from_summary_counts_and_shows_the_first_notes():
    notes = [f"['p{i}']: not in the checkpoint, keeps its init (2,)" for i in range(6)]
    notes += ["['pos_embedding']: [CLS] row dropped (this model pools without [CLS]); "
              "resampled grid (4, 4) -> (2, 2)",
              "['encoder']['layers']['fc']: the first 1 of the saved layers (2)",
              "['cls']: in the checkpoint but not in this model, ignored"]
    text = init_from_lib.init_from_summary("/ckpt", notes, shown=3)
    assert text.splitlines() == [
        "init_from /ckpt: 9 parameter(s) not loaded as they are (7 skipped, 2 adapted):",
        *(f"  {n}" for n in notes[:3]), "  ... and 6 more"]


def test_a_hybrid_position_table_is_resampled_from_its_real_grid():
    """A hybrid ViT (ResNet stem, stride 16) on 64 x 256 images with 1 x 1 patches has a 4 x 16
    grid, not image_size / patch_size; its 64 rows are not a square 8 x 8 grid either."""
    from posjax.layers.positions import resample_position_table
    saved_cfg = {"config": {"image_size": [64, 256], "patch_size": 1,
                            "resnet_layers": [1, 1, 1]}}
    table = np.random.default_rng(0).normal(size=(1, 64, 4)).astype(np.float32)
    target = {"pos_embedding": jnp.zeros((1, 8 * 32, 4))}
    replicated = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    merged, notes = init_from_lib.merge_pretrained(target, {"['pos_embedding']": table},
                                               {"pos_embedding": replicated}, saved_cfg, (8, 32))
    assert notes == ["['pos_embedding']: resampled grid (4, 16) -> (8, 32)"]
    np.testing.assert_array_equal(merged["pos_embedding"],
                                  resample_position_table(table, (4, 16), (8, 32),
                                                          num_prefix_tokens=0))


def test_a_text_position_table_is_interpolated_to_more_rows():
    """interpolate_position_rows: prefix rows kept; position rows corner-aligned linear (the
    old first and last rows at the ends, row j at old position j·(R − 1)/(rows − 1))."""
    from posjax.layers.positions import interpolate_position_rows
    table = np.array([[9.0, -9.0], [0.0, 10.0], [1.0, 20.0], [2.0, 40.0]], np.float32)
    out = np.asarray(interpolate_position_rows(table, 5, num_prefix_rows=1))
    np.testing.assert_allclose(out, [[9, -9], [0, 10], [0.5, 15], [1, 20], [1.5, 30],
                                     [2, 40]], rtol=1e-6)
    out = np.asarray(interpolate_position_rows(table[1:], 7))
    np.testing.assert_allclose(out[:, 0], [0, 1 / 3, 2 / 3, 1, 4 / 3, 5 / 3, 2], rtol=1e-6)
    assert out.dtype == np.float32


def test_split_tags_keep_splits_apart():
    tags = [results_lib.split_tag(s) for s in ("test", "train[:80%]", "train[80%:]", "dev/x", "a b")]
    assert tags == ["test", "train_-80%", "train_80%-", "dev_x", "a_b"]


def test_eval_tags_keep_other_data_apart():
    saved = config_defaults.config_dict(syn.tiny_config(**{"data": {"data_dir": "/d", "test_split": "t"}}))
    same = syn.tiny_config(**{"data": {"data_dir": "/d", "test_split": "v", "worker_count": 2}})
    assert results_lib.eval_tag(None, same) == "" and results_lib.eval_tag(saved, same) == ""
    assert results_lib.eval_tag(saved, syn.tiny_config(**{"data": {"path": "/p", "data_dir": "/d"}}))
    other = syn.tiny_config(**{"data": {"data_dir": "/e"}})
    assert results_lib.eval_tag(saved, other) == results_lib.eval_tag(saved, other.copy_and_resolve_references())
    assert results_lib.eval_tag(saved, other) not in ("", results_lib.eval_tag(
        saved, syn.tiny_config(**{"data": {"data_dir": "/f"}})))


def test_operational_keys_may_change_on_resume():
    a = config_defaults.config_dict(syn.tiny_config())
    b = config_defaults.config_dict(syn.tiny_config(**{"mesh.data": 2, "checkpoint.every_steps": 5,
                                            "log_every_steps": 3, "eval_batch_size": 8}))
    assert run_config.config_differences(a, b) == []


# ----------------------------------------------------------------------------- metrics


def test_metric_accumulator_weights():
    acc = metrics.MetricAccumulator()
    acc.add({"loss": (jnp.float32(6.0), jnp.float32(3.0)), "grad_norm": jnp.float32(1.0)})
    acc.add({"loss": (jnp.float32(2.0), jnp.float32(1.0)), "grad_norm": jnp.float32(3.0)})
    assert acc.result() == {"loss": 2.0, "grad_norm": 2.0}


def test_divergence_checks_sums_and_every_state_value():
    acc = metrics.MetricAccumulator()
    acc.add({"loss": (jnp.float32(0.0), jnp.float32(0.0)), "grad_norm": jnp.float32(0.0)})
    assert acc.all_finite(errors_lib.DIVERGENCE_METRICS)   # a batch without weight is no divergence
    acc.add({"loss": (jnp.float32(jnp.nan), jnp.float32(1.0)), "grad_norm": jnp.float32(1.0)})
    assert not acc.all_finite(errors_lib.DIVERGENCE_METRICS)
    assert acc.all_finite(("grad_norm",))
    state = state_lib.TrainState(step=jnp.int32(3), params={"w": jnp.ones((2, 2))},
                                 opt_state=(jnp.zeros(2), {"nu": jnp.ones(3)}))
    assert state_lib.all_finite(state)
    assert not state_lib.all_finite(state.replace(opt_state=(jnp.zeros(2),
                                                             {"nu": jnp.array([1, jnp.inf, 1.])})))


def test_jsonl_drops_records_after_the_resume_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "split": "train", "loss": 1.0}) + "\n"
                            for s in (1, 2, 3, 4)))
    metrics.drop_after(path, 2)
    assert [r["step"] for r in metrics.read_metrics(path)] == [1, 2]


def test_peak_flops_sources():
    configured = peak_flops.peak_flops_per_device(5e12)
    assert (configured.value, configured.source, configured.measure) == (
        5e12, "config.peak_flops", None)
    measured = peak_flops.peak_flops_per_device()
    assert measured.value > 1e8 and measured.source.startswith("measured")   # CPU: no table
    assert measured.measure is peak_flops.measure_matmul_flops


def test_best_rate_keeps_the_fastest_trial():
    clock = iter([0.0, 3.0, 10.0, 12.0, 20.0, 25.0]).__next__   # trials of 3 s, 2 s, 5 s
    calls = []
    assert peak_flops.best_rate(8.0, lambda: calls.append(1), 3, timer=clock) == 4.0
    assert len(calls) == 3


def test_mfu_above_one_remeasures_and_raises_a_measured_peak():
    measurements = iter([150.0, 400.0])
    peak = peak_flops.PeakFlops(100.0, "measured", measure=lambda: next(measurements))
    assert peak.mfu(50.0) == 0.5 and peak.value == 100.0        # <= 1: not re-measured
    assert peak.mfu(200.0) == 1.0 and peak.value == 200.0       # re-measured 150 < achieved
    assert peak.mfu(300.0) == 0.75 and peak.value == 400.0      # re-measured 400
    fixed = peak_flops.PeakFlops(100.0, "config.peak_flops")
    assert fixed.mfu(200.0) == 2.0 and fixed.value == 100.0     # a configured peak is kept


def test_batch_feeds_on_the_local_mesh():
    mesh = mesh_lib.build_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices())
    feeds = mesh_lib.batch_feeds(mesh)
    assert feeds.feed_of == {0: 0} and feeds.count == 1   # one process holds every batch row
    assert mesh_lib.process_feed(mesh) == (0, 1)
    np.testing.assert_array_equal(feeds.feed_order(8), np.arange(8))


@pytest.mark.parametrize("rows,shards,groups,feed_of", [
    ({0: {0, 1}, 1: {2, 3}}, 4, ((0, 1), (2, 3)), {0: 0, 1: 1}),
    ({1: {0, 1}, 0: {2, 3}}, 4, ((0, 1), (2, 3)), {1: 0, 0: 1}),   # process 1 feeds first
    ({0: {0, 2}, 1: {1, 3}}, 4, ((0, 2), (1, 3)), {0: 0, 1: 1}),   # interleaved (physical)
    ({0: {0, 1}, 1: {0, 1}}, 2, ((0, 1),), {0: 0, 1: 0}),          # tensor across hosts
    ({0: {0}, 1: {1}, 2: {2}, 3: {3}}, 4, ((0,), (1,), (2,), (3,)), {0: 0, 1: 1, 2: 2, 3: 3}),
])
def test_feed_groups(rows, shards, groups, feed_of):
    feeds = mesh_lib.feed_groups(rows, shards, "mesh M")
    assert feeds.groups == groups and dict(feeds.feed_of) == feed_of


def test_feed_order_puts_each_feeds_rows_together():
    feeds = mesh_lib.feed_groups({0: {0, 2}, 1: {1, 3}}, 4, "mesh M")
    np.testing.assert_array_equal(feeds.rows(0, 8), [0, 1, 4, 5])
    np.testing.assert_array_equal(feeds.feed_order(8), [0, 1, 4, 5, 2, 3, 6, 7])


@pytest.mark.parametrize("rows,shards", [
    ({0: {0, 1}, 1: {1, 2}}, 3),          # overlapping but unequal
    ({0: {0, 1, 2}, 1: {3}}, 4),          # feeds of unequal size
])
def test_feed_groups_refuse_meshes_no_feed_can_fill(rows, shards):
    with pytest.raises(ValueError, match="overlapping but unequal"):
        mesh_lib.feed_groups(rows, shards, "mesh M")


def _wait_for(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)    # the main thread runs Python signal handlers between bytecodes
    return predicate()


def test_stop_request_is_set_by_sigterm_or_ctrl_c_and_restores_the_handlers(terminal_signals):
    """(A second Ctrl-C ends the process: tests/test_train_cli.py checks it in a subprocess.)"""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGTERM):
        with stop_request.StopRequest() as stop:
            assert not stop.requested
            os.kill(os.getpid(), signum)
            assert _wait_for(lambda: stop.requested)
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)   # nohup: stays ignored
    try:
        with stop_request.StopRequest() as stop:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) != before[1]
    finally:
        signal.signal(signal.SIGINT, previous)


LOCK_RECORD_ONLY = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)   # as a run on another machine holds it over NFS
os.write(fd, b'{"pid": 7, "host": "node-b", "since": "2026-11-30 09:00:00 UTC"}')
print("holding", flush=True)
time.sleep(60)
"""


def test_the_workdir_lock_also_holds_through_its_record_file(tmp_path):
    """NFS keeps a directory's flock on one machine but carries a regular file's: a run whose
    lock only reaches the record file (another node) keeps the workdir too."""
    import subprocess
    from posjax.training import workdir_lock
    holder = subprocess.Popen([sys.executable, "-c", LOCK_RECORD_ONLY,
                               str(tmp_path / workdir_lock.LOCK_FILE)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        with pytest.raises(ValueError, match=r"is in use by another training run \(pid 7 on "
                                             r"host node-b, since 2026-11-30 09:00:00 UTC\)"):
            with workdir_lock.exclusive(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with workdir_lock.exclusive(tmp_path):   # free once the holder is gone
        assert json.loads((tmp_path / workdir_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / workdir_lock.LOCK_FILE).exists()


def test_the_workdir_is_checked_again_once_locked(tmp_path, monkeypatch):
    """A run that ends in the workdir between this run's checks and its lock (having saved
    with another config) is seen: refused, not resumed with this config."""
    from posjax.training import workdir_lock
    config = syn.tiny_config()
    other = syn.tiny_config(**{"optimizer.learning_rate": 0.05})
    original = workdir_lock.exclusive

    def another_run_ends_first(workdir, enabled=True):
        _checkpointed_workdir(workdir, other)
        return original(workdir, enabled)

    monkeypatch.setattr(workdir_lock, "exclusive", another_run_ends_first)
    with pytest.raises(ValueError, match=r"holds a run with another config(.|\n)*"
                                         r"optimizer.learning_rate: 0.05 -> "):
        trainer.train(config, tmp_path / "w")
    assert json.loads((tmp_path / "w" / config_defaults.CONFIG_FILE).read_text()) == config_defaults.config_dict(other)


def test_after_a_failed_save_asyncio_echoes_of_its_writes_are_dropped(tmp_path):
    """A write task of the failed save collected late is logged by asyncio as 'Task exception
    was never retrieved' with a traceback (its message names no file, its exception is the
    storage error): dropped, as are records naming the checkpoints; anything else is kept."""
    import logging
    import sys

    echoes = ckpt_lib._EchoesOfFailedSave(tmp_path)

    def record(message, error=None):
        exc_info = None
        if error is not None:
            try:
                raise error
            except type(error):
                exc_info = sys.exc_info()
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, (), exc_info)

    late = "Task exception was never retrieved\nfuture: <Task finished coro=<Store.write() done>>"
    assert not echoes.filter(record(late, OSError(27, "File too large")))
    assert not echoes.filter(record(f"reading {tmp_path.resolve() / '2' / 'state'} failed"))
    assert echoes.filter(record(late, ZeroDivisionError("a bug")))
    assert echoes.filter(record("another folder's write failed"))


def test_a_save_that_fails_for_another_reason_than_storage_is_no_save_failed(tmp_path):
    """SaveFailed says 'is the disk full?': a bug (here a state Orbax cannot save) keeps its own
    error and traceback instead."""
    import grain
    checkpointer = ckpt_lib.Checkpointer(tmp_path, every_steps=1, keep=0, async_save=False)
    iterator = iter(grain.MapDataset.range(4).to_iter_dataset())
    try:
        with pytest.raises(Exception) as raised:
            checkpointer.save(1, {"weights": np.ones(2), "note": object()}, iterator)
        assert not isinstance(raised.value, ckpt_lib.SaveFailed), raised.value
        assert not ckpt_lib._is_storage_error(raised.value)
    finally:
        checkpointer.close()
    assert ckpt_lib._is_storage_error(OSError(28, "No space left on device"))
    assert ckpt_lib._is_storage_error(ValueError(
        "OUT_OF_RANGE: Error writing local file \"x\": File too large [os_error_code='27']"))
