"""The workdir: what a run or an evaluation accepts in it (entries, config.json, metrics,
the saved config against this one), atomic writes, and the lock of one run per workdir."""
from __future__ import annotations

import json
import os
import sys

import pytest

from posjax import config_defaults
from posjax.training import run_setup
from posjax.training import trainer
from posjax.training import workdir as workdir_lib

import synthetic_runs as syn


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
    from posjax.training.checkpointing import lock as workdir_lock
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
    from posjax.training.checkpointing import lock as workdir_lock
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
