"""A damaged newest checkpoint does not stop a resume: it is moved aside
(``<step>.damaged-<reason>``) with one warning, and the run resumes from the newest intact step
and ends as an undisturbed run does. Each step carries an integrity record (sizes, CRC-32s)
written after its commit, so a file cut short, gone or silently changed is found. eval.py
evaluates the newest intact step and names it. Only when no step is intact does a resume stop
(tests/test_training_runs.py: ``test_a_damaged_checkpoint_is_named_with_the_way_out``).
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from posjax.training import evaluator
from posjax.training import run_setup
from posjax.training import trainer
from posjax.training.checkpointing import checkpointer as ckpt_lib
from posjax.training.checkpointing import integrity

import synthetic_runs as syn
from jax_env import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An undisturbed run: steps 2, 4, 6 saved; its final eval."""
    config = syn.tiny_config()
    workdir = tmp_path_factory.mktemp("fallback") / "straight"
    result = trainer.train(config, workdir)
    return config, workdir, result


def _copy(workdir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)
    return copy


def _largest_file(step_dir):
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def test_every_saved_step_carries_an_integrity_record(straight):
    _, workdir, _ = straight
    for step in (2, 4, 6):
        step_dir = workdir / "checkpoints" / str(step)
        record = json.loads((step_dir / integrity.RECORD_FILE).read_text())["files"]
        assert record == integrity.describe(step_dir)
        assert any(name.startswith("state/") for name in record)
        assert any(name.startswith("data_iter/") for name in record)


def _damage_truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def _damage_flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [(_damage_truncate, "truncated"),
                                            (_damage_flip, "checksum"),
                                            (lambda p: p.unlink(), "missing")])
def test_a_damaged_newest_step_is_moved_aside_and_the_run_resumes_from_the_one_before(
        straight, tmp_path, caplog, damage, reason):
    config, straight_dir, straight_result = straight
    workdir = _copy(straight_dir, tmp_path)
    (workdir / "checkpoints" / "eval_6_test.json").unlink()
    damage(_largest_file(workdir / "checkpoints" / "6"))
    with caplog.at_level(logging.WARNING):
        result = trainer.train(config, workdir)
    assert result.start == 4 and result.step == 6 and not result.preempted
    aside = workdir / "checkpoints" / f"6.damaged-{reason}"
    assert aside.is_dir()
    warnings = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()
                or "moved aside" in r.getMessage()]
    assert len(warnings) == 1 and f"moved aside to {aside}; using step 4 instead" in warnings[0]
    assert integrity.saved_steps(workdir) == [2, 4, 6]   # the listing ignores the aside
    assert result.eval == pytest.approx(straight_result.eval, abs=1e-6)


def test_a_step_with_non_finite_values_is_moved_aside(straight, tmp_path, caplog):
    """A step whose saved state holds a NaN (written and recorded as such: no damage of the
    files) is not resumed from."""
    config, straight_dir, straight_result = straight
    workdir = _copy(straight_dir, tmp_path)
    (workdir / "checkpoints" / "eval_6_test.json").unlink()
    run = run_setup.prepare(config, workdir, training=False)
    checkpointer = ckpt_lib.Checkpointer(workdir, 2, 0)
    pipe = run.make_pipeline("train", config.batch_size, True)
    state = checkpointer.restore(6, run.abstract, pipe.iterator)
    poisoned = state.replace(params=jax.tree_util.tree_map(lambda x: x * np.nan, state.params))
    shutil.rmtree(workdir / "checkpoints" / "6")
    checkpointer.manager.reload()
    checkpointer.save(6, poisoned, pipe.iterator, force=True)
    checkpointer.close()
    pipe.iterator.close()
    assert integrity.damage(workdir / "checkpoints" / "6") is None   # recorded as written
    with caplog.at_level(logging.WARNING):
        result = trainer.train(config, workdir)
    assert result.start == 4 and (workdir / "checkpoints" / "6.damaged-non-finite").is_dir()
    assert result.eval == pytest.approx(straight_result.eval, abs=1e-6)


def test_a_moved_aside_step_survives_checkpoint_keep(straight, tmp_path):
    """keep=1 rotates every older step out, but never the aside one (Orbax lists only
    step-number names)."""
    config, straight_dir, _ = straight
    workdir = _copy(straight_dir, tmp_path)
    _damage_truncate(_largest_file(workdir / "checkpoints" / "6"))
    config = syn.tiny_config(**{"num_steps": 10, "checkpoint.keep": 1})
    trainer.train(config, workdir)
    names = sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.is_dir())
    assert names == ["10", "6.damaged-truncated"]
    assert ocp.utils.checkpoint_steps(workdir / "checkpoints") == [10]


def test_eval_uses_the_newest_intact_step_and_names_it(straight, tmp_path, caplog):
    config, straight_dir, _ = straight
    workdir = _copy(straight_dir, tmp_path)
    _damage_flip(_largest_file(workdir / "checkpoints" / "6"))
    with caplog.at_level(logging.WARNING):
        result = evaluator.evaluate(config, workdir)
    assert result["step"] == 4
    assert any("evaluating step 4 instead" in r.getMessage() and "CRC-32" in r.getMessage()
               for r in caplog.records)
    assert (workdir / "checkpoints" / "6").is_dir()   # eval.py moves nothing
    with pytest.raises(ValueError, match=r"^eval_step=6: checkpoint .*/6 cannot be restored "
                                         r"\(.*CRC-32 differs\)\); the intact steps in "
                                         r".* are \[2, 4\]"):
        evaluator.evaluate(config, workdir, step=6)


def _tree(path):
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in path.rglob("*")}


def test_eval_step_picks_a_step_and_a_bad_one_is_one_error_listing_the_intact_steps(
        straight, tmp_path):
    """config.eval_step=N evaluates step N though a newer one is intact; a value that is not a
    step's number, a step that is not saved and a damaged step are each one ValueError naming
    eval_step and the intact steps, before anything is written. eval.py's --step is the same
    setting: both given and different is one error."""
    _, straight_dir, _ = straight
    workdir = _copy(straight_dir, tmp_path)
    checkpoints = workdir / "checkpoints"
    _damage_truncate(_largest_file(checkpoints / "6"))
    listing = re.escape(f"the intact steps in {checkpoints} are [2, 4]: give one of them "
                        "(--config.eval_step=N), or leave eval_step unset for the newest (4)")
    not_a_step = r"is not valid: give a saved step's number \(an integer >= 0\); "
    refused = {
        -1: rf"eval_step=-1 {not_a_step}{listing}",
        2.5: rf"eval_step=2\.5 {not_a_step}{listing}",
        "4": rf"eval_step='4' {not_a_step}{listing}",
        True: rf"eval_step=True {not_a_step}{listing}",
        5: rf"eval_step=5: {re.escape(str(checkpoints))} holds no such step; {listing}",
        6: rf"eval_step=6: checkpoint {re.escape(str(checkpoints / '6'))} cannot be restored "
           rf"\(state/\S+ holds \d+ bytes, \d+ were saved\); {listing}",
    }
    before = _tree(workdir)
    for value, match in refused.items():
        with pytest.raises(ValueError, match=f"^{match}$"):
            evaluator.evaluate(syn.tiny_config(eval_step=value), workdir)
    with pytest.raises(ValueError, match=r"^--step 2 and eval_step=4 name different steps"):
        evaluator.evaluate(syn.tiny_config(eval_step=4), workdir, step=2)
    assert _tree(workdir) == before
    assert evaluator.evaluate(syn.tiny_config(eval_step=4), workdir)["step"] == 4
    assert (checkpoints / "eval_4_test.json").is_file()
    assert evaluator.evaluate(syn.tiny_config(eval_step=2), workdir, step=2)["step"] == 2


# eval.py with the synthetic task of the tests registered.
EVAL_PY = ("import runpy, sys; sys.path.insert(0, 'tests'); import synthetic_runs; "
           "sys.argv[0] = 'eval.py'; runpy.run_path('eval.py', run_name='__main__')")


def test_eval_py_takes_config_eval_step_over_the_saved_config(straight, tmp_path):
    """``--config.eval_step=N`` overrides the run's saved config (whose eval_step is unset)
    and is not another config than the run's; a value that is not a step is one error line."""
    _, straight_dir, _ = straight
    workdir = _copy(straight_dir, tmp_path)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(8)}

    def eval_py(*args):
        return subprocess.run([sys.executable, "-c", EVAL_PY, f"--workdir={workdir}", *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    bad = eval_py("--config.eval_step=-3")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines()[-1] == (
        f"error: eval_step=-3 is not valid: give a saved step's number (an integer >= 0); the "
        f"intact steps in {workdir / 'checkpoints'} are [2, 4, 6]: give one of them "
        "(--config.eval_step=N), or leave eval_step unset for the newest (6)")
    done = eval_py("--config.eval_step=4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["step"] == 4
    assert (workdir / "checkpoints" / "eval_4_test.json").is_file()


def test_the_integrity_record_is_written_off_the_training_thread(tmp_path, monkeypatch):
    """A save's read-back for the CRC-32s never runs on the training thread: ``wait`` returns
    (the step committed) while its record is still being written, in another thread; ``close``
    returns with the record on disk."""
    import threading

    import grain
    import jax.numpy as jnp

    began, release, on_main = threading.Event(), threading.Event(), []
    write_record = integrity.write_record

    def held_record(step_dir):
        on_main.append(threading.current_thread() is threading.main_thread())
        began.set()
        assert release.wait(120)
        write_record(step_dir)

    monkeypatch.setattr(integrity, "write_record", held_record)
    checkpointer = ckpt_lib.Checkpointer(tmp_path, 2, 0)
    data_iter = iter(grain.MapDataset.range(8).to_iter_dataset())
    assert checkpointer.save(2, {"w": jnp.arange(6.0)}, data_iter)
    checkpointer.wait()   # committed: the record is begun, not waited for
    step_dir = tmp_path / "checkpoints" / "2"
    assert began.wait(120) and on_main == [False]
    assert not integrity.has_record(step_dir) and integrity.saved_steps(tmp_path) == [2]
    release.set()
    checkpointer.close()
    assert integrity.has_record(step_dir) and integrity.damage(step_dir) is None


def test_a_step_without_its_record_is_checked_by_reading_it(straight, tmp_path, caplog):
    """A process killed between a step's commit and its record leaves the step unrecorded: a
    resume still reads it (intact: resumed from), and one whose files were cut short is passed
    over and moved aside, not taken."""
    config, straight_dir, straight_result = straight
    workdir = _copy(straight_dir, tmp_path)
    (workdir / "checkpoints" / "eval_6_test.json").unlink()
    for step in (4, 6):
        (workdir / "checkpoints" / str(step) / integrity.RECORD_FILE).unlink()
    # The arrays' data file the restore reads (state/d/: the per-process OCDBT files under
    # ocdbt.process_*/ and the _sharding file are not read back; only the record sees them).
    data = max((workdir / "checkpoints" / "6" / "state" / "d").iterdir(),
               key=lambda f: f.stat().st_size)
    _damage_truncate(data)
    with caplog.at_level(logging.WARNING):
        result = trainer.train(config, workdir)
    assert result.start == 4, "the unrecorded, intact step 4 is resumed from"
    assert [p.name for p in (workdir / "checkpoints").glob("6.damaged-*")], \
        "the unrecorded step 6, cut short, is found by reading it and moved aside"
    assert result.eval == pytest.approx(straight_result.eval, abs=1e-6)
