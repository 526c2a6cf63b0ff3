"""init_from a train.py workdir: only the params are read (not the optimizer moments), a
ViT head that read pre_logits features is not reused by a model without them, and a damaged
one is one error."""
from __future__ import annotations

import gc
import json
import logging
import re
import sys
import time

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import synthetic_runs as syn
from posjax.training import run_setup
from posjax.training import init_from_checks
from posjax.training import init_from as init_from_lib
from posjax.training import state as state_lib
from posjax.training.tasks import make_task


def write_workdir(path, config) -> dict:
    """A workdir as train.py leaves it: checkpoints/<step>/state holding step, params and the
    AdamW state, and config.json. Returns the saved params."""
    task = make_task(config)
    params = nn.unbox(task.init_params(task.build_model(), jax.random.PRNGKey(3),
                                       task.dummy_batch(2)))
    params = jax.tree.map(lambda x: np.asarray(x) + 0.5, params)
    opt_state = optax.adamw(1e-3).init(params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "checkpoints" / "4" / "state",
                   {"step": np.int32(4), "params": params, "opt_state": opt_state})
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    return params


def test_workdir_params_load_and_a_pre_logits_head_is_not_reused(tmp_path, caplog):
    source = syn.tiny_config(**{"model.representation_size": 16})
    saved = write_workdir(tmp_path / "source", source)
    assert "pre_logits" in saved

    config = syn.tiny_config(**{"init_from": str(tmp_path / "source")})
    run = run_setup.prepare(config, tmp_path / "run", training=True)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings, 0)
    loaded, _ = init_from_lib.read_pretrained(tmp_path / "source", state.params,
                                          run.shardings.params)
    assert sorted(loaded) == sorted(jax.tree_util.keystr(p) for p, _ in
                                    jax.tree_util.tree_leaves_with_path(saved))

    fresh = jax.tree.map(np.asarray, state.params)
    with caplog.at_level(logging.WARNING):
        params = init_from_lib.load_init_from(state, str(tmp_path / "source"), run.shardings).params
    # Same head shape (16 -> 4 classes either way), but it read tanh(pre_logits) features.
    np.testing.assert_array_equal(np.asarray(params["head"]["kernel"]), fresh["head"]["kernel"])
    np.testing.assert_array_equal(np.asarray(params["head"]["bias"]), fresh["head"]["bias"])
    warning = "\n".join(r.getMessage() for r in caplog.records)
    assert "['head']['kernel']: read pre_logits features in the checkpoint" in warning
    assert "['pre_logits']['kernel']: in the checkpoint but not in this model" in warning
    q = params["encoder"]["layer_0"]["attention"]["query"]["kernel"]
    np.testing.assert_array_equal(np.asarray(q),
                                  saved["encoder"]["layer_0"]["attention"]["query"]["kernel"])


def test_same_features_keep_the_pretrained_head(tmp_path):
    saved = write_workdir(tmp_path / "source", syn.tiny_config())
    config = syn.tiny_config(**{"init_from": str(tmp_path / "source")})
    run = run_setup.prepare(config, tmp_path / "run", training=True)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings, 0)
    params = init_from_lib.load_init_from(state, str(tmp_path / "source"), run.shardings).params
    np.testing.assert_array_equal(np.asarray(params["head"]["kernel"]), saved["head"]["kernel"])


def test_a_damaged_init_from_is_one_error_and_nothing_else(tmp_path, monkeypatch, caplog):
    """Data files cut short: one ValueError naming the folder; none of the other failed reads
    is logged or printed after it (given as a relative path, as users do)."""
    write_workdir(tmp_path / "source", syn.tiny_config())
    for data in (tmp_path / "source" / "checkpoints" / "4" / "state").rglob("d/*"):
        data.write_bytes(data.read_bytes()[:10])
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.chdir(tmp_path)
    config = syn.tiny_config(**{"init_from": "source"})
    with pytest.raises(ValueError) as refused:   # before anything is compiled or written
        run_setup.prepare(config, tmp_path / "run", training=True)
    message = str(refused.value)
    assert re.fullmatch(
        rf"init_from='source': {tmp_path}/source/checkpoints/4/state: cannot read this "
        r"checkpoint \(ValueError: (OUT_OF_RANGE|DATA_LOSS): [^\n]*\); if it is damaged \(a "
        r"full disk, an interrupted copy\), copy or convert it again", message), message
    assert "tensorstore_spec" not in message and len(message) < 900, message
    assert not (tmp_path / "run").exists()
    time.sleep(1)   # reads still in flight finish
    gc.collect()    # failed tasks nobody awaited are reported when collected
    assert [r.getMessage()[:200] for r in caplog.records if r.name == "asyncio"] == []
    assert [str(u.exc_value) for u in unraisable] == []


def test_a_body_parameter_of_another_shape_is_refused_before_training(tmp_path):
    """A checkpoint whose patch embedding (or vocabulary) has another shape than this model's
    would train a pretrained body behind a random input layer: one error naming the
    parameter and the config fields, at prepare. A head of another size is re-initialised."""
    write_workdir(tmp_path / "source", syn.tiny_config(**{"model.patch_size": 2}))
    config = syn.tiny_config(**{"init_from": str(tmp_path / "source")})
    with pytest.raises(ValueError, match=re.escape(
            "1 parameter(s) of this model outside its heads would not load from the pretrained "
            "model and would keep a random init: ['embedding']['kernel'] (saved (2, 2, 1, 16), "
            "here (4, 4, 1, 16)). Give config.model the pretrained model's values: "
            "--config.model.patch_size=\"(2, 2)\", or start without init_from")):
        run_setup.prepare(config, tmp_path / "run", training=True)
    assert not (tmp_path / "run").exists()

    write_workdir(tmp_path / "classes", syn.tiny_config(**{"model.num_classes": 7}))
    config = syn.tiny_config(**{"init_from": str(tmp_path / "classes")})
    run_setup.prepare(config, tmp_path / "run2", training=True)   # another head: fine-tuning


def test_a_text_checkpoint_with_another_vocabulary_is_refused(tmp_path):
    import dataclasses
    from model_inputs import random_params
    from posjax import TextConfig, TextForMaskedLM
    from posjax.convert import Pretrained, save_checkpoint
    cfg = TextConfig(position_scheme="deberta_v2", vocab_size=40, hidden_size=16, num_heads=2,
                     num_layers=1, mlp_dim=32)
    batch = dict(input_ids=np.zeros((1, 8), np.int32), attention_mask=np.ones((1, 8), np.int32))
    saved = random_params(TextForMaskedLM(cfg), **batch)["params"]
    folder = save_checkpoint(Pretrained(cfg, saved, "text", "mlm"), tmp_path / "ckpt")
    wider = dataclasses.replace(cfg, vocab_size=48)
    target = jax.eval_shape(lambda: random_params(TextForMaskedLM(wider), **batch)["params"])
    with pytest.raises(ValueError, match=r"\['word_embeddings'\]\['embedding'\] \(saved \(40, 16\)"
                                         r", here \(48, 16\)\)\. Give config\.model the "
                                         r"pretrained model's values: "
                                         r"--config\.model\.vocab_size=40, or start"):
        init_from_checks.check_init_from(folder, target, model_config=wider)
    init_from_checks.check_init_from(folder, jax.eval_shape(lambda: saved), model_config=cfg)


def _text_checkpoint(tmp_path, **fields):
    import dataclasses
    from model_inputs import random_params
    from posjax import TextConfig, TextForMaskedLM
    from posjax.convert import Pretrained, save_checkpoint
    cfg = TextConfig(**{**dict(position_scheme="deberta_v2", vocab_size=40, hidden_size=16,
                               num_heads=2, num_layers=2, mlp_dim=32), **fields})
    batch = dict(input_ids=np.zeros((1, 8), np.int32), attention_mask=np.ones((1, 8), np.int32))
    saved = random_params(TextForMaskedLM(cfg), **batch)["params"]
    folder = save_checkpoint(Pretrained(cfg, saved, "text", "mlm"), tmp_path / "ckpt")

    def target(**changes):
        other = dataclasses.replace(cfg, **changes)
        return other, jax.eval_shape(
            lambda: random_params(TextForMaskedLM(other), **batch)["params"])
    return folder, saved, target


def test_a_shallower_scanned_model_takes_the_first_layers_and_a_deeper_one_is_refused(tmp_path):
    from posjax.models.layout import to_layout
    folder, saved, target = _text_checkpoint(tmp_path)
    cfg, params = target(num_layers=1, scan_layers=True)
    init_from_checks.check_init_from(folder, params, model_config=cfg)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    loaded, saved_cfg = init_from_lib.read_pretrained(folder, params,
                                                  jax.tree.map(lambda _: replicated, params))
    merged, notes = init_from_lib.merge_pretrained(jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                                                            params), loaded,
                                               jax.tree.map(lambda _: replicated, params),
                                               saved_cfg)
    assert notes and all("the first 1 of the saved layers (2)" in n for n in notes)
    stacked = to_layout(saved, True)["encoder"]["encoder"]["layers"]["mlp"]["fc1"]["kernel"]
    np.testing.assert_array_equal(
        merged["encoder"]["encoder"]["layers"]["mlp"]["fc1"]["kernel"], stacked[:1])
    for scan in (False, True):
        cfg, params = target(num_layers=3, scan_layers=scan)
        with pytest.raises(ValueError, match=r"would keep a random init: .*Give config\.model the "
                                             r"pretrained model's values: "
                                             r"--config\.model\.num_layers=2, or start"):
            init_from_checks.check_init_from(folder, params, model_config=cfg)
    folder0, _, target0 = _text_checkpoint(tmp_path / "v3", type_vocab_size=0)
    cfg, params = target0(type_vocab_size=2)
    with pytest.raises(ValueError, match=r"token_type_embeddings'\]\['embedding'\] \(not in "
                                         r"the checkpoint\).*--config\.model\.type_vocab_size=0"):
        init_from_checks.check_init_from(folder0, params, model_config=cfg)


def test_a_vit_for_another_grid_gets_the_pretrained_values(tmp_path):
    """DeBERTa's relative table on a ViT grid spans the grid's side by default: another
    image_size is refused with the one flag that fixes it (not image_size, which would undo
    the new resolution)."""
    source = syn.tiny_config(**{"model.position_scheme": "deberta_v2", "model.image_size": 8,
                                "model.pooling": "gap"})
    write_workdir(tmp_path / "source", source)
    config = syn.tiny_config(**{"model.position_scheme": "deberta_v2", "model.image_size": 16,
                                "model.pooling": "gap", "init_from": str(tmp_path / "source")})
    with pytest.raises(ValueError, match=re.escape(
            ". Give config.model the pretrained model's values: "
            "--config.model.max_relative_positions=2, or start without init_from")):
        run_setup.prepare(config, tmp_path / "run", training=True)


@pytest.mark.parametrize("scan", [False, True])
def test_a_layer_of_another_width_is_refused_with_that_width(tmp_path, scan):
    """Another mlp_dim or num_heads inside the layers (unrolled: layer_N, scanned: layers)
    is advised as that field, also in a shallower model (which may take the first layers)."""
    folder, _, target = _text_checkpoint(tmp_path)
    for changes, flags in (({"mlp_dim": 64}, "--config.model.mlp_dim=32"),
                           ({"mlp_dim": 64, "num_layers": 1}, "--config.model.mlp_dim=32"),
                           ({"num_heads": 4}, "--config.model.num_heads=2")):
        cfg, params = target(scan_layers=scan, **changes)
        with pytest.raises(ValueError, match=re.escape(
                f". Give config.model the pretrained model's values: {flags}, or start")):
            init_from_checks.check_init_from(folder, params, model_config=cfg)


def test_fields_the_saved_config_does_not_hold_are_named_not_guessed(tmp_path):
    """A model_config.json without vocab_size, or none at all: the advice names the fields
    instead of giving the dataclass defaults as the pretrained model's values."""
    folder, _, target = _text_checkpoint(tmp_path)
    cfg, params = target(vocab_size=48)
    saved = json.loads((folder / "model_config.json").read_text())
    del saved["config"]["vocab_size"]
    (folder / "model_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=re.escape(
            ". Give config.model the pretrained model's vocab_size (model_config.json there "
            "does not say it), or start")):
        init_from_checks.check_init_from(folder, params, model_config=cfg)
    (folder / "model_config.json").unlink()
    with pytest.raises(ValueError, match=re.escape(
            ". Give config.model the pretrained model's embedding_size, vocab_size (there is "
            "no model_config.json there to say them), or start")):
        init_from_checks.check_init_from(folder, params, model_config=cfg)
    # A train.py workdir leaves out fields at their defaults, but only in a config.json.
    write_workdir(tmp_path / "run", syn.tiny_config(**{"model.patch_size": 2}))
    (tmp_path / "run" / "config.json").unlink()
    with pytest.raises(ValueError, match=re.escape(
            ". Give config.model the pretrained model's num_channels, patch_size (there is no "
            "config.json there to say them), or start")):
        run_setup.prepare(syn.tiny_config(init_from=str(tmp_path / "run")), tmp_path / "new",
                     training=True)


def test_eval_of_the_weights_as_they_are_drops_no_layer(tmp_path):
    """eval.py (whole=True) on a model shallower than the checkpoint: refused, with either
    layer layout (a scanned stack would otherwise take the first layers)."""
    folder, _, target = _text_checkpoint(tmp_path)
    for scan in (False, True):
        cfg, params = target(num_layers=1, scan_layers=scan)
        with pytest.raises(ValueError, match=r"eval.py evaluates these weights as they are, "
                                             r"but .*\. Give config\.model the pretrained "
                                             r"model's values: --config\.model\.num_layers=2, "
                                             r"or train with train\.py"):
            init_from_checks.check_init_from(folder, params, model_config=cfg, whole=True)
        init_from_checks.check_init_from(folder, params, model_config=cfg)   # train.py: first layers


def test_a_hybrid_stem_of_another_shape_names_its_fields(tmp_path):
    source = syn.tiny_config(**{"model.resnet_layers": (1,), "model.resnet_width": 32,
                                "model.image_size": 16, "model.patch_size": 1})
    write_workdir(tmp_path / "source", source)
    for field, value, flag in (("resnet_layers", (2,), '--config.model.resnet_layers="(1,)"'),
                               ("resnet_width", 64, "--config.model.resnet_width=32")):
        config = syn.tiny_config(**{"model.resnet_layers": (1,), "model.resnet_width": 32,
                                    "model.image_size": 16, "model.patch_size": 1,
                                    f"model.{field}": value,
                                    "init_from": str(tmp_path / "source")})
        with pytest.raises(ValueError, match=re.escape(
                f". Give config.model the pretrained model's values: {flag}, or start")):
            run_setup.prepare(config, tmp_path / "run", training=True)
