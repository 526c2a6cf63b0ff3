"""Elastic resume (``checkpointing.input_position``): a run saved by N processes on mesh M
resumes on N' processes on mesh M' (the same global batch) and ends as the uninterrupted run.

* Every task's training pipeline saves one global input position: after k batches, shard 0
  and shard 1 of 2 hold the same state, and a 1-shard pipeline set to it yields the next global
  batch (and the other way round), for images, synthetic images, MLM text, GLUE and the
  study's synthetic position tasks.
* Real runs (digits :tiny, dropout and mixup): 2 processes preempted, resumed by 1 process;
  1 process stopped, resumed by 2 processes; 8 devices data=8 resumed as fsdp=4 x tensor=2:
  the loss at every step within 1e-5 of the uninterrupted 1-process run.
* Positions that differ between the saving processes are refused with one error.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from jax_env import compilation_cache
from posjax.training import trainer
from posjax.training.checkpointing import input_position
from posjax.training.tasks import make_task
import synthetic_runs as syn
import test_multiprocess as mp

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONSUMED = 3   # batches read before the state is taken


def _text_config():
    from configs.text_recipes import mlm_config
    return mlm_config("bert_a", "tiny")


def _glue_config():
    from configs.text_recipes import glue_config
    return glue_config("sst2", "tiny")


def _synth_config():
    from posjax.study import synthetic
    config = _text_config()
    config.task = "position_synth"
    config.data = synthetic.default_data_config("shift", 32)
    config.model.max_position_embeddings = 32
    config.model.vocab_size = synthetic.vocab_size(config.data)
    return config


CONFIGS = {"digits": lambda: mp.digits_tiny(), "synthetic_images": syn.tiny_config,
           "mlm_text": _text_config, "glue": _glue_config, "position_synth": _synth_config}
NEEDS_DATA = ("mlm_text", "glue")


def _pipelines(task, shard_count: int, per_shard: int) -> list:
    return [task.make_pipeline("train", per_shard, 7, True, i, shard_count).iterator
            for i in range(shard_count)]


def _rows(batches: list[dict]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([np.asarray(b[key]) for b in batches]) for key in batches[0]}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_training_pipeline_saves_one_global_position(name, request):
    if name in NEEDS_DATA:
        request.getfixturevalue("shared_data")
    task = make_task(CONFIGS[name]())
    two = _pipelines(task, 2, 4)
    for _ in range(CONSUMED):
        for it in two:
            next(it)
    states = [json.dumps(it.get_state(), sort_keys=True) for it in two]
    assert states[0] == states[1]
    one = _pipelines(task, 1, 8)[0]
    one.set_state(json.loads(states[0]))       # 2 -> 1: the next global batch
    expected = _rows([next(it) for it in two])
    got = next(one)
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(np.asarray(got[key]), expected[key], err_msg=key)
    again = _pipelines(task, 2, 4)              # 1 -> 2: the rows of the next global batch
    for it in again:
        it.set_state(one.get_state())
    following = next(one)
    split = _rows([next(it) for it in again])
    for key in split:
        np.testing.assert_array_equal(split[key], np.asarray(following[key]), err_msg=key)


def test_positions_that_differ_between_processes_are_refused(tmp_path):
    step = tmp_path / "12"
    (step / "data_iter").mkdir(parents=True)
    for i, index in enumerate((12, 13)):
        (step / "data_iter" / f"process_{i}-of-2.json").write_text(
            json.dumps({"next_index": index}))
    with pytest.raises(ValueError, match=rf"checkpoint {step} holds a different input position "
                       r"for each of the 2 processes that saved it, not one global position: "
                       r"resume it with 2 processes \(this run has 1\)"):
        input_position.saved_by_others(step, 1)
    assert input_position.saved_by_others(step, 2) is None   # the same count: Orbax's own
    (step / "data_iter" / "process_1-of-2.json").write_text(json.dumps({"next_index": 12}))
    assert json.loads(input_position.saved_by_others(step, 1)) == {"next_index": 12}
    (step / "data_iter" / "process_1-of-2.json").unlink()    # incomplete: Orbax reports it
    assert input_position.saved_by_others(step, 1) is None


# -- real runs ---------------------------------------------------------------------------------

STOP = 8


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """The 1-process 8-device run to the end (mesh data 8): the losses every resumed run must
    give; the 2-process launches share a compilation cache."""
    root = tmp_path_factory.mktemp("elastic")
    mp._JAX_CACHE.update(compilation_cache(root / "jax_cache"))
    trainer.train(mp.digits_tiny(**mp.OVERRIDES), root / "single")
    return mp._train_losses(root / "single")


def _same_losses(workdir: pathlib.Path, expected: dict[int, float]) -> None:
    losses = mp._train_losses(workdir)
    assert sorted(losses) == sorted(expected) == list(range(1, mp.NUM_STEPS + 1))
    for step, loss in expected.items():
        assert abs(losses[step] - loss) <= 1e-5, (step, losses[step], loss)


def test_two_processes_resumed_by_one_end_as_the_uninterrupted_run(uninterrupted, tmp_path,
                                                                   caplog):
    workdir = tmp_path / "run"
    first = mp.launch(workdir, tmp_path, "two", sigterm_to=(0, 1), after_step=3)
    stopped = mp._stopped_step(first[0][0])
    assert all(code == 0 for _, code in first) and stopped < mp.NUM_STEPS
    files = sorted(p.name for p in (workdir / "checkpoints" / str(stopped) / "data_iter"
                                    ).glob("process_*"))
    assert files == ["process_0-of-2.json", "process_1-of-2.json"]
    with caplog.at_level("INFO"):
        result = trainer.train(mp.digits_tiny(**mp.OVERRIDES), workdir)
    assert result.start == stopped and result.step == mp.NUM_STEPS
    assert "was saved by 2 process(es), this run has 1" in caplog.text
    _same_losses(workdir, uninterrupted)


def test_one_process_resumed_by_two_ends_as_the_uninterrupted_run(uninterrupted, tmp_path):
    workdir = tmp_path / "run"
    trainer.train(mp.digits_tiny(**mp.OVERRIDES), workdir, stop_after=STOP)
    resumed = mp.launch(workdir, tmp_path, "resumed")
    for output, code in resumed:
        assert code == 0, output[-3000:]
    assert f"resuming from {workdir / 'checkpoints' / str(STOP)}" in resumed[0][0]
    _same_losses(workdir, uninterrupted)


def test_a_run_on_data_8_resumes_on_fsdp_4_tensor_2(uninterrupted, tmp_path):
    workdir = tmp_path / "run"
    trainer.train(mp.digits_tiny(**mp.OVERRIDES, **{"mesh.data": 8}), workdir, stop_after=STOP)
    other_mesh = {"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}
    result = trainer.train(mp.digits_tiny(**mp.OVERRIDES, **other_mesh), workdir)
    assert result.start == STOP and result.step == mp.NUM_STEPS
    _same_losses(workdir, uninterrupted)


def test_a_run_on_a_bucket_resumes_on_another_mesh(uninterrupted, emulator):
    """The same on a gs:// workdir (gcp-storage-emulator): arrays saved on data 8 are read
    back resharded onto fsdp 4 × tensor 2 from the bucket."""
    from posjax import storage
    workdir = f"{emulator}/elastic"
    trainer.train(mp.digits_tiny(**mp.OVERRIDES, **{"mesh.data": 8}), workdir, stop_after=STOP)
    other_mesh = {"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}
    result = trainer.train(mp.digits_tiny(**mp.OVERRIDES, **other_mesh), workdir)
    assert result.start == STOP and result.step == mp.NUM_STEPS
    _same_losses(storage.as_path(workdir), uninterrupted)
