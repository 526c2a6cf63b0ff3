"""Whole training runs on the synthetic task (one fixture, the runs overlap in time):

* train, stop, resume: bit-identical to the uninterrupted run, and the resumed run sees the
  same next batch;
* a checkpoint restores onto another mesh and device count; eval reproduces the final eval and
  writes one file per evaluated split;
* init_from loads converter output (matching by path, new heads keep their init) and says in
  one warning what it did not load as is;
* a step out of device memory is one error naming what fills the device and the keys to change.

Real multi-process runs: tests/test_multiprocess.py.
"""
from __future__ import annotations

import gc
import json
import logging
import math
import re
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from posjax import config_defaults
from posjax.models.config import TextConfig
from posjax.training import errors as errors_lib
from posjax.training import evaluator
from posjax.training import mesh as mesh_lib
from posjax.training import run_setup
from posjax.training import steps as steps_lib
from posjax.training import trainer
from posjax.training import workdir as workdir_lib
from posjax.training import init_from_checks
from posjax.training import init_from as init_from_lib
from posjax.training import state as state_lib
from posjax.training.checkpointing import checkpointer as ckpt_lib
from posjax.training.checkpointing import integrity
from posjax.training.tasks import make_task

import synthetic_runs as syn


def _restore(config, workdir, step, devices=None, mesh_cfg=None):
    """State at ``step`` restored onto ``mesh_cfg`` over ``devices`` (default: the config's)."""
    task = make_task(config)
    model = task.build_model()
    run = run_setup.prepare(config, workdir, training=False)
    mesh = mesh_lib.build_mesh(mesh_cfg or config.mesh, devices)
    abstract, _ = state_lib.abstract_state(task, model, run.tx, mesh, config.seed)
    checkpointer = ckpt_lib.Checkpointer(workdir, 1, 0, create=False)
    state = checkpointer.restore(step, abstract)
    checkpointer.close()
    return state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(config, uninterrupted workdir, stopped-and-resumed workdir, stop result)."""
    root = tmp_path_factory.mktemp("runs")
    config = syn.tiny_config()   # mesh data=-1: 8 x 1 x 1
    trainer.train(config, root / "straight")
    stopped = trainer.train(config, root / "resumed", stop_after=3)
    trainer.train(config, root / "resumed")
    return config, root / "straight", root / "resumed", stopped


def _records(workdir):
    return [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_resumed_run_is_bit_identical(runs):
    config, straight, resumed, stopped = runs
    assert stopped.preempted and stopped.step == 3 and stopped.eval == {}
    a = _restore(config, straight, 6)
    b = _restore(config, resumed, 6)
    assert int(a.step) == int(b.step) == 6
    for x, y in zip(jax.tree.leaves((a.params, a.opt_state)),
                    jax.tree.leaves((b.params, b.opt_state))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Same per-step losses, each step logged once, same final eval.
    train_a = [(r["step"], r["loss"]) for r in _records(straight) if r["split"] == "train"]
    train_b = [(r["step"], r["loss"]) for r in _records(resumed) if r["split"] == "train"]
    assert train_a == train_b and [s for s, _ in train_a] == list(range(1, 7))
    assert workdir_lib.eval_file(straight, 6, "test").read_text() == \
        workdir_lib.eval_file(resumed, 6, "test").read_text()
    assert (resumed / "loss_curve.png").stat().st_size > 0


def test_resumed_iterator_yields_the_next_batch(runs):
    config, _, resumed, _ = runs
    task = make_task(config)
    fresh = task.make_pipeline("train", config.batch_size, config.seed, True, 0, 1).iterator
    expected = [next(fresh) for _ in range(4)][-1]   # the 4th batch: first after step 3
    iterator = task.make_pipeline("train", config.batch_size, config.seed, True, 0, 1).iterator
    run = run_setup.prepare(config, resumed, training=False)
    checkpointer = ckpt_lib.Checkpointer(resumed, 1, 0, create=False)
    checkpointer.restore(3, run.abstract, iterator)
    checkpointer.close()
    got = next(iterator)
    for k in expected:
        np.testing.assert_array_equal(got[k], expected[k])


def test_restore_onto_another_mesh_and_device_count(runs):
    config, straight, _, _ = runs
    a = _restore(config, straight, 6)                                   # 8 devices, data 8
    b = _restore(config, straight, 6, jax.devices()[:4], {"fsdp": 2, "tensor": 2})
    kernel = b.params["encoder"]["layer_0"]["attention"]["query"]["kernel"]
    assert len(kernel.sharding.device_set) == 4
    assert kernel.sharding.shard_shape(kernel.shape) == (8, 1, 8)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_eval_reproduces_the_training_eval(runs):
    config, straight, _, _ = runs
    written_by_training = workdir_lib.eval_file(straight, 6, "test").read_text()
    result = evaluator.evaluate(config, straight)
    written = json.loads(workdir_lib.eval_file(straight, 6, "test").read_text())
    assert result == written and written["num_examples"] == 40 and written["split"] == "test"
    assert json.loads(written_by_training) == written
    # Another split gets its own file; the test split's stays as it was.
    other = config.copy_and_resolve_references()
    other.data = {"test_split": "train[:50%]"}
    assert evaluator.evaluate(other, straight)["split"] == "train[:50%]"
    assert workdir_lib.eval_file(straight, 6, "train[:50%]").name == "eval_6_train_-50%.json"
    assert workdir_lib.eval_file(straight, 6, "train[:50%]").exists()
    assert workdir_lib.eval_file(straight, 6, "test").read_text() == written_by_training
    # Other data than the run's (a data_dir it did not read) is written beside, not over, the
    # run's results, and the file says which data it is.
    moved = config.copy_and_resolve_references()
    moved.data = {"data_dir": "/elsewhere"}
    evaluator.evaluate(moved, straight)
    tag = workdir_lib.eval_tag(config_defaults.read_saved_config(straight), moved)
    assert re.fullmatch(r"_data-[0-9a-f]{8}", tag)
    assert json.loads(workdir_lib.eval_file(straight, 6, "test", tag).read_text())["data"] == \
        {"data.data_dir": "/elsewhere"}
    assert workdir_lib.eval_file(straight, 6, "test").read_text() == written_by_training
    with pytest.raises(ValueError, match="holds no such step"):
        evaluator.evaluate(config, straight, step=5)


def test_eval_prints_its_progress(runs, monkeypatch, capsys):
    """A line per EVAL_PROGRESS_S after the first batch (its compile): batches done of the
    pass, examples/s, ETA. 40 examples in batches of 16: 3 batches."""
    config, straight, _, _ = runs
    monkeypatch.setattr(evaluator, "EVAL_PROGRESS_S", 0.0)
    evaluator.evaluate(config, straight)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("eval batch")]
    assert [ln.split()[2] for ln in lines] == ["2/3", "3/3"]
    assert re.fullmatch(r"eval batch 3/3  examples_per_s [0-9.e+]+  ETA 0:00:00", lines[-1])
    progress = evaluator.EvalProgress(None)
    assert progress.batch_done(16) is None and "2/?" in progress.batch_done(16)


def test_eval_of_init_from_weights_as_they_are(runs, tmp_path):
    """eval.py with config.init_from in a workdir that is not a run's evaluates those weights
    as they are, as step 0: a finished run's give its own final metrics. Weights that would
    not fill the model (a head on another layer), another pooling or an eval_step are one error
    each, before anything is written; a run's workdir without a checkpoint is still
    refused."""
    config, straight, _, _ = runs
    pretrained = syn.tiny_config(init_from=str(straight))
    result = evaluator.evaluate(pretrained, tmp_path / "eval")
    assert result == {**json.loads(workdir_lib.eval_file(straight, 6, "test").read_text()), "step": 0}
    assert json.loads(workdir_lib.eval_file(tmp_path / "eval", 0, "test").read_text()) == result
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["checkpoints"]
    refused = {
        "a pre_logits layer": ({"model.representation_size": 8}, 0, re.escape(
            "eval.py evaluates these weights as they are, but 3 parameter(s) of this model "
            "would keep a random init: ['head']['kernel'] (saved (16, 4), here (8, 4)), "
            "['pre_logits']['bias'] (not in the checkpoint), "
            "['pre_logits']['kernel'] (not in the checkpoint). Give config.model the "
            "pretrained model's heads")),
        "another pooling": ({"model.pooling": "gap"}, 0, re.escape(
            "has pooling='token' where this run's config.model has pooling='gap'")),
        "a step": ({}, 2, r"eval_step=2: .*holds no saved step; leave eval_step unset: "
                          r"eval.py then evaluates config.init_from's weights \(as step 0\)"),
    }
    for name, (overrides, step, match) in refused.items():
        with pytest.raises(ValueError, match=match):
            evaluator.evaluate(syn.tiny_config(init_from=str(straight), **overrides),
                          tmp_path / name, step=step or None)
        assert not (tmp_path / name).exists(), name
    _, export = _export(syn.tiny_config(**{"model.representation_size": 8}), tmp_path)
    with pytest.raises(ValueError, match=re.escape(
            "1 parameter(s) of this model would keep a random init: ['head']['kernel'] "
            "(saved (8, 4), here (16, 4)); "
            "2 parameter(s) of the checkpoint would be left out: ['pre_logits']['bias'], "
            "['pre_logits']['kernel']. Give")):
        evaluator.evaluate(syn.tiny_config(init_from=str(export)), tmp_path / "left_over")
    assert not (tmp_path / "left_over").exists()
    run_without_checkpoint = tmp_path / "run"
    (run_without_checkpoint / "checkpoints").mkdir(parents=True)
    shutil.copy(straight / config_defaults.CONFIG_FILE, run_without_checkpoint / config_defaults.CONFIG_FILE)
    with pytest.raises(ValueError, match="holds no saved step yet: train there first"):
        evaluator.evaluate(pretrained, run_without_checkpoint)


def test_rerunning_a_finished_run_logs_its_final_eval_once(runs):
    config, straight, _, _ = runs
    written = workdir_lib.eval_file(straight, 6, "test").read_text()
    result = trainer.train(config, straight)
    assert result.step == 6 and not result.preempted
    assert result.eval == {k: v for k, v in json.loads(written).items()
                           if k not in ("step", "split")}
    assert [r["step"] for r in _records(straight) if r["split"] == "eval"] == [6]
    assert workdir_lib.eval_file(straight, 6, "test").read_text() == written


def test_a_final_eval_cut_short_by_a_crash_is_logged_once_by_the_rerun(runs, tmp_path):
    """Killed between logging the final eval and writing its JSON, or the other way round: the
    rerun leaves exactly one eval record of the last step (it logged a second one)."""
    config, straight, _, _ = runs
    workdir = _copy_run(straight, tmp_path)
    workdir_lib.eval_file(workdir, 6, "test").unlink()          # record logged, JSON not written
    trainer.train(config, workdir)
    assert [r["step"] for r in _records(workdir) if r["split"] == "eval"] == [6]
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    (workdir / "metrics.jsonl").write_text(            # JSON written, record not logged
        "".join(ln + "\n" for ln in lines if json.loads(ln)["split"] != "eval"))
    trainer.train(config, workdir)
    assert [r["step"] for r in _records(workdir) if r["split"] == "eval"] == [6]


def test_a_training_run_removes_partial_saves_and_an_evaluation_does_not(runs, tmp_path):
    """A run killed mid-save leaves <step>.orbax-checkpoint-tmp (a full-size partial copy): the
    next training run there removes it; eval.py, which may run beside a saving run, does not."""
    config, straight, _, _ = runs
    workdir = _copy_run(straight, tmp_path)
    partial = workdir / "checkpoints" / "7.orbax-checkpoint-tmp"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "data").write_bytes(b"cut short")
    evaluator.evaluate(config, workdir)
    assert partial.exists()
    trainer.train(config, workdir)
    assert not partial.exists() and integrity.saved_steps(workdir)[-1] == 6


def test_eval_beside_a_run_that_rotates_the_step_out_reads_the_new_latest(runs, tmp_path,
                                                                          monkeypatch):
    """A run training in the workdir removes old steps (checkpoint.keep) while eval.py starts:
    with eval_step unset the new latest is evaluated; with eval_step=N, one error says what
    happened (it said the checkpoint might be damaged)."""
    config, straight, _, _ = runs
    workdir = _copy_run(straight, tmp_path)
    original = ckpt_lib.Checkpointer.restore

    def rotated_out_first(self, step, *args, **kwargs):
        if (self.directory / "6").exists():
            shutil.rmtree(self.directory / "6")   # as the run's keep policy does
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(ckpt_lib.Checkpointer, "restore", rotated_out_first)
    assert evaluator.evaluate(config, workdir)["step"] == 4
    shutil.copytree(straight / "checkpoints" / "6", workdir / "checkpoints" / "6")
    with pytest.raises(ValueError, match=rf"^eval_step=6: {workdir / 'checkpoints' / '6'} "
                                         r"was removed while it was read \(a run training "
                                         r"there keeps only the latest checkpoint.keep steps\); "
                                         r"evaluate one of \[2, 4\] with --config.eval_step=N"):
        evaluator.evaluate(config, workdir, step=6)

    # Caught mid-removal (Orbax deletes in place) once the run saved step 8 with keep = 1.
    def being_removed_first(self, step, *args, **kwargs):
        if step == 6 and not (self.directory / "8").exists():
            shutil.copytree(self.directory / "6", self.directory / "8")
            shutil.rmtree(self.directory / "6" / "state")
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(ckpt_lib.Checkpointer, "restore", being_removed_first)
    shutil.copytree(straight / "checkpoints" / "6", workdir / "checkpoints" / "6")
    one_kept = config.copy_and_resolve_references()
    one_kept.checkpoint.keep = 1
    assert evaluator.evaluate(one_kept, workdir)["step"] == 8


def test_eval_closes_the_checkpointer_when_the_restore_fails(runs, tmp_path, monkeypatch):
    """A checkpoint that does not fit the config (no config.json to compare it with: another
    optimizer state) raises from Orbax's restore; the checkpointer is closed all the same."""
    config, straight, _, _ = runs
    workdir = tmp_path / "copy"
    shutil.copytree(straight / "checkpoints", workdir / "checkpoints")
    closed = []
    close = ckpt_lib.Checkpointer.close
    monkeypatch.setattr(ckpt_lib.Checkpointer, "close",
                        lambda self: (closed.append(1), close(self)))
    other = syn.tiny_config(**{"optimizer.name": "sgd"})
    with pytest.raises(ValueError, match="tree structures do not match"):
        evaluator.evaluate(other, workdir)
    assert closed == [1]


def test_init_from_converter_checkpoint(tmp_path, caplog):
    """Params saved as the converter does (StandardCheckpointer of {'params': tree} plus
    model_config.json) are loaded by path; a head with another num_classes and a position
    table for another grid are handled (kept / resampled)."""
    source = syn.tiny_config(**{"model.num_classes": 6, "model.image_size": 16,
                                "model.patch_size": 4})
    task = make_task(source)
    params = jax.device_get(task.init_params(task.build_model(), jax.random.PRNGKey(3),
                                             task.dummy_batch(2)))
    params = jax.tree.map(lambda x: np.asarray(x) + 0.5, __import__("flax").linen.unbox(params))
    export = tmp_path / "export"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(export / "params", {"params": params})
    (export / "model_config.json").write_text(json.dumps(source.model.to_dict()))

    config = syn.tiny_config(**{"init_from": str(export)})
    run = run_setup.prepare(config, tmp_path / "run", training=True)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings, 0)
    fresh = jax.tree.map(np.asarray, state.params)
    with caplog.at_level(logging.WARNING):
        loaded = init_from_lib.load_init_from(state, str(export), run.shardings,
                                          run.task.patch_grid).params
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings     # one summary, not one line per parameter
    assert warnings[0].startswith(f"init_from {export}: 3 parameter(s) not loaded as they are "
                                  "(2 skipped, 1 adapted):")
    assert "['head']['kernel']: shape (16, 6) in the checkpoint, (16, 4) here" in warnings[0]
    q = ("encoder", "layer_0", "attention", "query", "kernel")
    np.testing.assert_array_equal(_get(loaded, q), _get(params, q))
    np.testing.assert_array_equal(loaded["head"]["kernel"], fresh["head"]["kernel"])  # 6 vs 4
    # 4x4 grid -> 2x2 grid: the [CLS] row kept, the grid rows resampled (not the fresh init).
    pos = np.asarray(loaded["pos_embedding"])
    assert pos.shape == (1, 5, 16)
    np.testing.assert_array_equal(pos[0, 0], params["pos_embedding"][0, 0])
    grid = params["pos_embedding"][0, 1:].reshape(4, 4, 16)
    np.testing.assert_allclose(pos[0, 1], grid[0, 0], atol=1e-6)     # corner-aligned (order 1)
    np.testing.assert_allclose(pos[0, 4], grid[3, 3], atol=1e-6)


def test_init_from_that_fits_no_encoder_parameter_is_refused_before_anything_is_written(
        tmp_path):
    """A checkpoint of another width: only the head bias (4 classes) would fit, so init_from
    would train from scratch under a pretrained name. One error, before the workdir exists."""
    source = syn.tiny_config(**{"model.hidden_size": 8, "model.mlp_dim": 16})
    task = make_task(source)
    params = jax.device_get(task.init_params(task.build_model(), jax.random.PRNGKey(3),
                                             task.dummy_batch(2)))
    export = tmp_path / "export"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(export / "params",
                   {"params": jax.tree.map(np.asarray, __import__("flax").linen.unbox(params))})
    (export / "model_config.json").write_text(json.dumps({"config": source.model.to_dict()}))
    for run in (trainer.train, evaluator.evaluate):   # eval.py's whole check names the width too
        with pytest.raises(ValueError, match=r"init_from='.*export': none of its 24 parameters "
                                             r"fits this model's encoder: give config.model"):
            run(syn.tiny_config(init_from=str(export)), tmp_path / "run")
        assert not (tmp_path / "run").exists()


def test_init_from_published_weights_says_to_convert_them_first(tmp_path):
    """A Hugging Face folder or an .npz given as init_from: the error gives the converter's
    command, before anything is written."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    for source in (hf, tmp_path / "ViT-B_16.npz"):
        with pytest.raises(ValueError, match=re.escape(
                f"it looks like published weights (a Hugging Face folder or an .npz); convert "
                f"them first, python -m posjax.convert --from {source} --to CKPT, then give "
                "init_from=CKPT")):
            trainer.train(syn.tiny_config(init_from=str(source)), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_init_from_whose_model_computes_another_function_is_refused_before_anything_is_written(
        tmp_path):
    """Weights of a model with exact GELU and LayerNorm eps 1e-12 (an HF ViT) fit a
    gelu_tanh / 1e-6 model shape for shape, and would then compute another function: one
    error naming both fields and the overrides, before the workdir exists. With those
    overrides (and a different dropout, which is free) the run starts."""
    _, export = _export(syn.tiny_config(**{"model.hidden_act": "gelu",
                                           "model.layer_norm_eps": 1e-12}), tmp_path)
    config = syn.tiny_config(**{"init_from": str(export), "model.hidden_act": "gelu_tanh"})
    with pytest.raises(ValueError) as error:
        trainer.train(config, tmp_path / "run")
    assert str(error.value) == (
        f"init_from={str(export)!r}: the pretrained model (model_config.json there) has "
        "hidden_act='gelu', layer_norm_eps=1e-12 where this run's config.model has "
        "hidden_act='gelu_tanh', layer_norm_eps=1e-06: its weights would compute another "
        "function here. Give config.model the pretrained values: "
        "--config.model.hidden_act=gelu --config.model.layer_norm_eps=1e-12")
    assert not (tmp_path / "run").exists()
    fixed = syn.tiny_config(**{"init_from": str(export), "model.hidden_act": "gelu",
                               "model.layer_norm_eps": 1e-12, "model.dropout_rate": 0.0})
    run_setup.prepare(fixed, tmp_path / "run", training=True)


def test_function_mismatches_reads_the_settings_of_the_scheme():
    """DeBERTa-v2 log buckets 8 over 32 positions and no buckets over 8 positions both have
    16 table rows; the scheme's settings are compared, those of schemes neither model uses,
    the dropout, the gather strategy and the layer layout are not."""
    saved = dict(position_scheme="deberta_v2", position_buckets=8, max_relative_positions=32,
                 relative_max_distance=64, dropout_rate=0.0, gather="take",
                 pos_att_type="c2p|p2c")
    ours = TextConfig(position_scheme="deberta_v2", max_relative_positions=8, scan_layers=True,
                      pos_att_type=("c2p", "p2c"))
    assert init_from_checks.function_mismatches(saved, ours) == [
        ("max_relative_positions", 32, 8), ("position_buckets", 8, 0)]
    # Another scheme: its settings are listed too, so that one error gives every override.
    assert init_from_checks.function_mismatches({**saved, "position_scheme": "tupe_r"}, ours) == [
        ("position_scheme", "tupe_r", "deberta_v2"), ("max_relative_positions", 32, 8),
        ("position_buckets", 8, 0), ("relative_max_distance", 64, 128)]
    assert init_from_checks.function_mismatches({"image_size": 8}, ours) == []   # not a text config
    # No model_config.json, or one with the grid alone: only what it says is compared.
    assert init_from_checks.function_mismatches({}, ours) == []
    assert init_from_checks.function_mismatches({"position_buckets": 4}, ours) == [
        ("position_buckets", 4, 0)]
    # A train.py run's config.json leaves out fields at their defaults.
    assert init_from_checks.function_mismatches({"max_relative_positions": 8}, ours,
                                         missing_are_defaults=True) == [
        ("position_scheme", "bert_abs", "deberta_v2")]
    # The order of pos_att_type does not matter; the pooler's activation does once it is loaded.
    assert init_from_checks.function_mismatches(
        {**saved, "position_buckets": 0, "max_relative_positions": 8,
         "pos_att_type": ("p2c", "c2p"), "pooler_act": "gelu"}, ours) == []
    assert init_from_checks.function_mismatches(
        {**saved, "position_buckets": 0, "max_relative_positions": 8, "pooler_act": "gelu"},
        ours, with_pooler=True) == [("pooler_act", "gelu", "tanh")]
    # The override the error prints for a tuple, as the shell passes it to ml_collections.
    assert init_from_checks._flag(("c2p",)) == "\"('c2p',)\"" and init_from_checks._flag(1e-12) == "1e-12"
    tupe = TextConfig(position_scheme="tupe_r", relative_max_distance=64)
    assert init_from_checks.function_mismatches(saved | {"position_scheme": "tupe_r"}, tupe) == []


@pytest.mark.parametrize("scheme", ["vit", "tupe_a"])
def test_init_from_resamples_to_a_non_square_grid(tmp_path, scheme):
    """A 4x4 patch grid fine-tuned on 8x16 images (grid 2x4): every per-patch position table
    (ViT's, and TUPE's with its extra first row) goes to the model's own grid, not a guessed
    square one."""
    model = {"model.image_size": 16, "model.patch_size": 4, "model.position_scheme": scheme}
    source = syn.tiny_config(**model)
    params, export = _export(source, tmp_path)

    config = syn.tiny_config(**model, init_from=str(export))
    config.model = dict(config.model.to_dict(), image_size=(8, 16))
    run = run_setup.prepare(config, tmp_path / "run", training=True)
    assert run.task.patch_grid == (2, 4)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings, 0)
    loaded = init_from_lib.load_init_from(state, str(export), run.shardings,
                                      run.task.patch_grid).params
    tables = {"vit": [(("pos_embedding",), 1)],
              "tupe_a": [(("encoder", "tupe_bias", "position_embeddings"), 2)]}[scheme]
    for path, prefix in tables:
        old, new = _get(params, path), _get(loaded, path)
        assert new.shape[-2] == prefix + 8
        np.testing.assert_array_equal(new[..., :prefix, :], old[..., :prefix, :])
        # Corner-aligned resampling 4 -> 2 rows takes rows 0 and 3; 4 -> 4 columns is exact.
        grid = old[..., prefix:, :].reshape(*old.shape[:-2], 4, 4, -1)
        np.testing.assert_allclose(new[..., prefix:, :].reshape(*old.shape[:-2], 2, 4, -1),
                                   grid[..., [0, 3], :, :], atol=1e-6)


def test_a_run_started_from_init_from_says_so(tmp_path, capsys):
    _, export = _export(syn.tiny_config(), tmp_path)
    config = syn.tiny_config(**{"init_from": str(export), "num_steps": 1,
                                "optimizer.warmup_steps": 0})
    trainer.train(config, tmp_path / "run")
    assert f"parameters initialised from {export}\n" in capsys.readouterr().out


# (position_scheme, its table holding a row for [CLS], the axis of the rows, [CLS]'s row).
CLS_ROW_TABLES = {
    "vit": (("pos_embedding",), 1, 0),   # (1, [CLS] + patches, H)
    "tupe_a": (("encoder", "tupe_bias", "position_embeddings"), 0, 1),   # (1 + [CLS] + ...)
    "bert_rel": (("encoder", "relative_bias", "rel_bias"), 1, -1),   # (2, buckets + [CLS], h)
}


@pytest.mark.parametrize("scheme, saved_pooling, pooling", [
    ("vit", "token", "gap"), ("vit", "gap", "token"), ("tupe_a", "token", "gap"),
    ("bert_rel", "gap", "token")])
def test_init_from_matches_the_cls_row_of_a_position_table(tmp_path, scheme, saved_pooling,
                                                           pooling):
    """[CLS] + 4x4 patches in the checkpoint, patches only here (pooling='gap'), or the reverse:
    the patch rows (or buckets) load as they are; the [CLS] row is dropped, or comes from the
    init."""
    source = syn.tiny_config(**{"model.image_size": 16, "model.patch_size": 4,
                                "model.pooling": saved_pooling, "model.position_scheme": scheme,
                                "model.relative_buckets": 8, "model.relative_max_distance": 8})
    params, export = _export(source, tmp_path)
    config = syn.tiny_config(**{"model.image_size": 16, "model.pooling": pooling,
                                "model.position_scheme": scheme, "model.relative_buckets": 8,
                                "model.relative_max_distance": 8, "init_from": str(export)})
    run = run_setup.prepare(config, tmp_path / "run", training=True)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings, 0)
    fresh = jax.tree.map(np.asarray, state.params)
    loaded = init_from_lib.load_init_from(state, str(export), run.shardings,
                                      run.task.patch_grid).params
    table, axis, cls = CLS_ROW_TABLES[scheme]
    saved_rows, rows = _get(params, table), _get(loaded, table)
    cls %= max(saved_rows.shape[axis], rows.shape[axis])   # the row in the table that has it
    assert rows.shape == _get(fresh, table).shape
    if pooling == "gap":
        np.testing.assert_array_equal(rows, np.delete(saved_rows, cls, axis=axis))
    else:
        np.testing.assert_array_equal(np.delete(rows, cls, axis=axis), saved_rows)
        np.testing.assert_array_equal(np.take(rows, [cls], axis=axis),
                                      np.take(_get(fresh, table), [cls], axis=axis))
    q = ("encoder", "layer_0", "attention", "query", "kernel")
    np.testing.assert_array_equal(_get(loaded, q), _get(params, q))


def _export(source, tmp_path):
    """(params, folder): a freshly initialised model of ``source`` saved as the converter
    does (params/ + model_config.json)."""
    task = make_task(source)
    params = jax.device_get(task.init_params(task.build_model(), jax.random.PRNGKey(3),
                                             task.dummy_batch(2)))
    params = jax.tree.map(np.asarray, __import__("flax").linen.unbox(params))
    export = tmp_path / "export"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(export / "params", {"params": params})
    (export / "model_config.json").write_text(json.dumps(source.model.to_dict()))
    return params, export


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return np.asarray(tree)


def _copy_run(source, tmp_path):
    workdir = tmp_path / "copy"
    shutil.copytree(source, workdir)
    return workdir


def test_a_checkpoint_of_another_model_is_named_as_such_not_as_damaged(runs, tmp_path,
                                                                      monkeypatch):
    """A run's checkpoints with another model config (a config.json replaced by another run's):
    one error naming the parameters that differ, before any array is read (nothing left in
    flight to report later); it does not send the user to move good checkpoints out."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    config, straight, _, _ = runs
    workdir = _copy_run(straight, tmp_path)
    wider = syn.tiny_config(**{"model.hidden_size": 24, "model.mlp_dim": 40})
    (workdir / config_defaults.CONFIG_FILE).write_text(json.dumps(config_defaults.config_dict(wider)))
    pattern = (r"holds the parameters of another model than config.model builds \(other "
               r"shapes: cls \(1, 1, 16\) saved, \(1, 1, 24\) in the model, .* in all\)\): "
               r"it was saved with another config.*not damaged$")
    with pytest.raises(ValueError, match=pattern):
        evaluator.evaluate(wider, workdir)
    deeper = syn.tiny_config(**{"model.num_layers": 2})
    (workdir / config_defaults.CONFIG_FILE).write_text(json.dumps(config_defaults.config_dict(deeper)))
    with pytest.raises(ValueError, match=r"\(not in the checkpoint: encoder/layer_1/"):
        evaluator.evaluate(deeper, workdir)
    gc.collect()
    assert unraisable == []


def test_a_damaged_checkpoint_is_named_with_the_way_out(runs, tmp_path, caplog, monkeypatch):
    """Data files of every step cut short (a full disk, an interrupted copy): one ValueError
    naming the newest step directory, the reader's reason and the older step, for a resume and
    for eval; and nothing else: none of the other failed reads is logged or printed after it."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    config, straight, _, _ = runs
    workdir = _copy_run(straight, tmp_path)
    steps = integrity.saved_steps(workdir)
    assert len(steps) >= 2
    for step in steps:   # every step: a resume falls back on an intact one (test_checkpoint_fallback)
        for data in (workdir / "checkpoints" / str(step) / "state").rglob("d/*"):
            data.write_bytes(data.read_bytes()[:10])
        (workdir / "checkpoints" / str(step) / "integrity.json").unlink()   # found by the read
    pattern = (rf"checkpoint {workdir / 'checkpoints' / str(steps[-1])} cannot be restored "
               rf"\(.*(OUT_OF_RANGE|DATA_LOSS).*\)\. If it is damaged \(a full disk, an "
               rf"interrupted copy\), move it out of {workdir / 'checkpoints'} to use step "
               rf"{steps[-2]} instead \(eval\.py: or --config\.eval_step={steps[-2]}\)")
    with pytest.raises(ValueError, match=pattern):
        trainer.train(config, workdir)
    with pytest.raises(ValueError, match=pattern):
        evaluator.evaluate(config, workdir)
    time.sleep(1)   # reads still in flight finish
    gc.collect()    # failed tasks nobody awaited are reported when collected
    assert [r.getMessage()[:200] for r in caplog.records if r.name == "asyncio"] == []
    assert [str(u.exc_value) for u in unraisable] == []


def test_a_resume_from_processes_with_different_positions_is_refused(runs, tmp_path):
    """Saved by '2 processes' whose input positions differ: resuming on 1 is refused naming
    the process count to use (same positions resume: tests/test_elastic_resume.py)."""
    config, straight, _, _ = runs
    workdir = _copy_run(straight, tmp_path)
    last = workdir / "checkpoints" / str(integrity.saved_steps(workdir)[-1])
    (last / "data_iter" / "process_0-of-1.json").rename(last / "data_iter" / "process_0-of-2.json")
    (last / "data_iter" / "process_1-of-2.json").write_text("{}")
    (last / "integrity.json").unlink(missing_ok=True)   # the files changed on purpose
    with pytest.raises(ValueError, match=rf"checkpoint {last} holds a different input position "
                                         r"for each of the 2 processes that saved it, not one "
                                         r"global position: resume it with 2 processes \(this "
                                         r"run has 1\)"):
        trainer.train(config, workdir)


def _out_of_memory() -> jax.errors.JaxRuntimeError:
    """XLA's own RESOURCE_EXHAUSTED: a 1 PiB output buffer, refused when it is allocated (more
    than any address space holds: nothing is computed)."""
    too_big = jax.jit(lambda x: jnp.sin(jnp.broadcast_to(x[:, None], (x.shape[0], 2**34))))
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED") as raised:
        too_big(jnp.ones((2**14,)))
    return raised.value


def _failing_at_call(make_step, n: int, error: Exception):
    """``make_step`` whose step raises ``error`` at its ``n``-th call (1-based)."""
    def make(*args, **kwargs):
        step = make_step(*args, **kwargs)
        calls = []

        def run(*a):
            calls.append(1)
            if len(calls) == n:
                raise error
            return step(*a)
        return run
    return make


def test_a_train_step_out_of_memory_names_what_to_change_and_keeps_the_checkpoints(
        tmp_path, monkeypatch, caplog):
    """The train step fails as XLA fails a batch too big for the devices (the error of a real
    refused allocation) at step 3, after step 2's checkpoint: one ValueError saying what each
    device holds and which keys make it fit (XLA's report logged in full); the checkpoint is
    kept and the run resumes from it once the step fits."""
    config = syn.tiny_config()
    monkeypatch.setattr(steps_lib, "make_train_step",
                        _failing_at_call(steps_lib.make_train_step, 3, _out_of_memory()))
    with pytest.raises(ValueError) as raised:
        trainer.train(config, tmp_path)
    message = str(raised.value)
    assert re.fullmatch(
        r"training ran out of memory \(Out of memory allocating 1125899906842624 bytes\.\)\. "
        r"Per device the train state \(parameters and optimizer state\) takes [0-9.]+ [KMG]?i?B; "
        r"the rest holds the gradients and one pass's activations \(2 examples per device\)\. "
        r"To fit it: lower batch_size \(now 16\) or raise microbatches \(now 1: each step "
        r"then runs in that many passes over parts of the batch, with the same gradients\), "
        r"set model.remat=True \(recompute each layer's activations in the backward pass\), "
        r"or shard the state over more devices \(mesh.fsdp, now 1; mesh.tensor, now 1\)\.",
        message), message
    assert "RESOURCE_EXHAUSTED: Out of memory allocating 1125899906842624 bytes." in caplog.text
    assert integrity.saved_steps(tmp_path) == [2]
    monkeypatch.undo()
    result = trainer.train(config, tmp_path)
    assert (result.start, result.step) == (2, config.num_steps)


def test_out_of_memory_advice_follows_the_state_and_the_batch(tmp_path, monkeypatch):
    """The bytes per device are the state's shards; a state that with its gradients (nearly)
    fills the device gets only the sharding advice; keys already at their limit (remat on, one
    example per device) are not offered."""
    config = syn.tiny_config(**{"mesh.data": 4, "mesh.fsdp": 2, "model.remat": True})
    run = run_setup.prepare(config, tmp_path, training=True)
    sizes = {"data": 4, "fsdp": 2, "tensor": 1}

    def expected_bytes(tree) -> int:
        total = 0
        for leaf in jax.tree.leaves(tree):
            spec = tuple(leaf.sharding.spec) + (None,) * len(leaf.shape)
            total += math.prod(
                n // math.prod(sizes[a] for a in ((s,) if isinstance(s, str) else s or ()))
                for n, s in zip(leaf.shape, spec)) * leaf.dtype.itemsize
        return total

    state, params = expected_bytes(run.abstract), expected_bytes(run.abstract.params)
    assert errors_lib.bytes_per_device(run.abstract) == state
    assert state < errors_lib.bytes_per_device(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), run.abstract))   # fsdp splits some
    monkeypatch.setattr(errors_lib, "device_memory_limit", lambda: state + params)
    message = errors_lib.out_of_memory_message(run, "Out of memory", False, True)
    size = errors_lib.byte_size(state + params)
    assert f"takes {errors_lib.byte_size(state)} of the device's {size}" in message
    assert message.endswith(f"To fit it: with the gradients it (nearly) fills each device "
                            f"({size}) whatever the batch: shard the state over more devices "
                            "(mesh.fsdp, now 2; mesh.tensor, now 1), or train a smaller model.")
    monkeypatch.setattr(errors_lib, "device_memory_limit", lambda: 100 * state)
    message = errors_lib.out_of_memory_message(run, "Out of memory", False, True)
    assert message.endswith("(2 examples per device). To fit it: lower batch_size (now 16) or "
                            "raise microbatches (now 1: each step then runs in that many passes "
                            "over parts of the batch, with the same gradients) or shard the "
                            "state over more devices (mesh.fsdp, now 2; mesh.tensor, now 1).")
    run.config.microbatches = 2
    message = errors_lib.out_of_memory_message(run, "Out of memory", False, True)
    assert message.endswith("(1 example per device). To fit it: shard the state over more "
                            "devices (mesh.fsdp, now 2; mesh.tensor, now 1).")
    message = errors_lib.out_of_memory_message(run, "Out of memory", True, False)
    assert f"Per device the parameters take {errors_lib.byte_size(params)} of the device's " in message


def test_an_eval_out_of_memory_names_eval_batch_size(runs, monkeypatch):
    config, straight, _, _ = runs
    monkeypatch.setattr(steps_lib, "make_eval_step",
                        _failing_at_call(steps_lib.make_eval_step, 1, _out_of_memory()))
    with pytest.raises(ValueError, match=r"^evaluation ran out of memory \(Out of memory "
                                         r"allocating 1125899906842624 bytes\.\)\. Per device "
                                         r"the parameters take [0-9.]+ [KMG]?i?B; the rest holds "
                                         r"one eval batch's activations \(2 examples per "
                                         r"device\)\. To fit it: lower eval_batch_size \(now "
                                         r"0; 0: batch_size, 16\) or shard the parameters"):
        evaluator.evaluate(config, straight)


def test_an_eval_out_of_memory_during_training_counts_the_train_state(tmp_path, monkeypatch):
    """A periodic eval out of memory: the train state is on the devices too (and step 2's
    checkpoint, saved before the eval, is kept)."""
    config = syn.tiny_config(eval_every_steps=2)
    monkeypatch.setattr(steps_lib, "make_eval_step",
                        _failing_at_call(steps_lib.make_eval_step, 1, _out_of_memory()))
    with pytest.raises(ValueError, match=r"^evaluation ran out of memory \(.*\)\. Per device "
                                         r"the train state \(parameters and optimizer state\) "
                                         r"takes [0-9.]+ [KMG]?i?B; the rest holds one eval batch's"):
        trainer.train(config, tmp_path)
    assert integrity.saved_steps(tmp_path) == [2]


@pytest.mark.parametrize("source", ["checkpoint", "init_from"])
def test_eval_holds_only_the_parameters_on_the_devices(runs, tmp_path, monkeypatch, source):
    """eval.py frees the optimizer state it restored (or initialised beside init_from's
    weights) before it evaluates, as its out-of-memory message says: the arrays alive at the
    first eval step add the parameters and a batch to those before, not the optimizer state."""
    config, straight, _, _ = runs
    workdir = straight
    if source == "init_from":
        config, workdir = syn.tiny_config(init_from=str(straight)), tmp_path / "eval"

    def live_bytes() -> int:
        return sum(a.nbytes for a in jax.live_arrays())

    during = []

    def measuring(make_step):
        def make(*args, **kwargs):
            step = make_step(*args, **kwargs)

            def run(*a):
                if not during:
                    during.append(live_bytes())
                return step(*a)
            return run
        return make
    monkeypatch.setattr(steps_lib, "make_eval_step",
                        measuring(steps_lib.make_eval_step))
    run = run_setup.prepare(config, workdir, training=False)
    params = sum(math.prod(x.shape) * x.dtype.itemsize
                 for x in jax.tree.leaves(run.abstract.params))
    opt = sum(math.prod(x.shape) * x.dtype.itemsize
              for x in jax.tree.leaves(run.abstract.opt_state))
    gc.collect()
    before = live_bytes()
    evaluator.evaluate(config, workdir)
    assert opt >= 2 * params   # AdamW's two moments
    assert during[0] - before < params + opt / 2, (during[0] - before, params, opt)


def test_train_records_the_share_of_time_spent_waiting_for_input(runs, tmp_path, monkeypatch):
    """``input_wait_share`` (seconds spent getting the next global batch per second of the log
    interval): in [0, 1] on every log after the first; when each batch takes 0.5 s to arrive,
    at least those 0.5 s of each one-step interval (1 / steps_per_s; the share itself depends
    on how fast the machine runs the step), and more than in the run without."""
    _, straight, _, _ = runs
    shares = [r["input_wait_share"] for r in _records(straight)
              if r["split"] == "train" and "steps_per_s" in r]
    assert len(shares) == 5 and all(0 <= s <= 1 for s in shares), shares
    global_batch = mesh_lib.global_batch

    def slow_global_batch(*args):
        time.sleep(0.5)
        return global_batch(*args)
    monkeypatch.setattr(mesh_lib, "global_batch", slow_global_batch)
    trainer.train(syn.tiny_config(num_steps=5), tmp_path)
    logs = [r for r in _records(tmp_path) if r["split"] == "train" and "steps_per_s" in r]
    slow = [r["input_wait_share"] for r in logs]
    waited = [r["input_wait_share"] / r["steps_per_s"] for r in logs]   # s per interval
    assert len(slow) == 4 and min(slow) > max(shares) and max(slow) <= 1, (slow, shares)
    assert min(waited) >= 0.5 * 0.99, waited   # the sleep, up to the records' rounding


def test_train_prints_the_parameter_count_and_the_state_per_device(tmp_path, monkeypatch):
    config = syn.tiny_config(**{"mesh.data": 4, "mesh.fsdp": 2})
    run = run_setup.prepare(config, tmp_path, training=True)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(run.abstract.params))
    held = errors_lib.bytes_per_device(run.abstract)
    assert errors_lib.state_size_line(run) == \
        f"{count:,} parameters; the train state takes {held / 2**10:.3g} KiB per device"
    monkeypatch.setattr(errors_lib, "device_memory_limit", lambda: 2**34)
    assert errors_lib.state_size_line(run).endswith(" per device (of the device's 16 GiB)")


def test_byte_sizes_in_words():
    assert [errors_lib.byte_size(n) for n in (512, 3584, 5 * 2**20, 1.03 * 2**30, 80 * 2**30)] == \
        ["512 B", "3.5 KiB", "5 MiB", "1.03 GiB", "80 GiB"]
