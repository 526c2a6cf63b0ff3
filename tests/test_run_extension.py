"""A run resumed with a larger ``num_steps`` (and other keys that change neither the model, the
data order nor the optimizer state) continues: config.json is updated, the change is printed,
and a decaying learning-rate schedule continues from the resumed step's value
(``optim.resumed_schedule``). Keys that change what a checkpoint means stay refused."""
from __future__ import annotations

import json

import numpy as np
import pytest

from posjax import config_defaults
from posjax.training import optim
from posjax.training import trainer

import synthetic_runs as syn


def _opt(**overrides):
    opt = dict(syn.tiny_config().optimizer)
    opt.update(overrides)
    return opt


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_an_extended_schedule_is_continuous_and_ends_at_the_end_value(kind):
    opt = _opt(schedule=kind, learning_rate=0.1, warmup_steps=5, end_learning_rate=0.001)
    old = optim.learning_rate_schedule(opt, 100)
    new = optim.piecewise_schedule(opt, [[0, 100], [60, 300]])
    steps = np.arange(0, 301)
    values = np.array([float(new(t)) for t in steps])
    np.testing.assert_allclose(values[:61], [float(old(t)) for t in range(61)], rtol=1e-6)
    assert abs(values[61] - values[60]) < abs(values[60] - values[59]) + 1e-9   # no jump
    assert np.all(np.diff(values[60:]) <= 1e-9)           # decays from there
    assert values[300] == pytest.approx(0.001, rel=1e-5)
    again = optim.piecewise_schedule(opt, [[0, 100], [60, 300], [200, 250]])
    assert float(again(200)) == pytest.approx(values[200], rel=1e-6)
    assert float(again(250)) == pytest.approx(0.001, rel=1e-5)


def test_a_change_within_the_warmup_takes_the_plain_schedule_for_the_new_length():
    opt = _opt(schedule="cosine", learning_rate=0.1, warmup_steps=10)
    new = optim.piecewise_schedule(opt, [[0, 100], [5, 400]])
    plain = optim.learning_rate_schedule(opt, 400)
    for t in (0, 3, 5, 9, 10, 150, 399):
        assert float(new(t)) == pytest.approx(float(plain(t)), rel=1e-6)


def test_extend_drops_segments_after_the_resumed_step():
    assert optim.extend([[0, 6]], 6, 10) == [[0, 6], [6, 10]]
    assert optim.extend([[0, 6], [6, 10]], 8, 10) == [[0, 6], [6, 10]]
    assert optim.extend([[0, 6], [6, 10]], 4, 12) == [[0, 6], [4, 12]]   # fell back to step 4


def _train_records(workdir):
    return {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").read_text()
                                      .splitlines()) if r["split"] == "train"}


def test_a_run_resumed_with_more_steps_continues_its_schedule(tmp_path, capsys):
    workdir = tmp_path / "run"
    stopped = trainer.train(syn.tiny_config(), workdir, stop_after=4)   # of 6; cosine, warmup 1
    assert stopped.preempted and stopped.step == 4
    first = _train_records(workdir)
    capsys.readouterr()
    longer = syn.tiny_config(**{"num_steps": 10, "checkpoint.keep": 2, "log_every_steps": 2,
                                "eval_every_steps": 4})
    result = trainer.train(longer, workdir)
    out = capsys.readouterr().out
    assert result.start == 4 and result.step == 10 and not result.preempted
    assert ("resumed with a changed config (config.json updated): checkpoint.keep: 0 -> 2; "
            "eval_every_steps: 0 -> 4; log_every_steps: 1 -> 2; num_steps: 6 -> 10") in out
    saved = json.loads((workdir / config_defaults.CONFIG_FILE).read_text())
    assert saved["num_steps"] == 10 and saved["checkpoint"]["keep"] == 2
    assert json.loads((workdir / optim.SCHEDULE_FILE).read_text()) == {"segments": [[0, 6],
                                                                                   [4, 10]]}
    records = _train_records(workdir)
    old = optim.learning_rate_schedule(longer.optimizer, 6)
    for step in range(1, 5):   # the steps taken keep their rates
        assert records[step]["lr"] == pytest.approx(float(old(step - 1)), rel=1e-6)
        assert records[step]["loss"] == first[step]["loss"]
    # From step 4 on: from old(4), the rate the old schedule gave there, down to the end.
    expected = optim.piecewise_schedule(longer.optimizer, [[0, 6], [4, 10]])
    assert float(expected(4)) == pytest.approx(float(old(4)), rel=1e-6) and float(old(4)) > 0
    for step in (6, 8, 10):
        assert records[step]["lr"] == pytest.approx(float(expected(step - 1)), rel=1e-6)
    assert float(old(4)) > records[6]["lr"] > records[8]["lr"] > records[10]["lr"] > 0
    # Resumed again, longer: a third segment from step 10's rate (the end value: 0 here).
    longest = syn.tiny_config(**{"num_steps": 12})
    assert trainer.train(longest, workdir).step == 12
    assert json.loads((workdir / optim.SCHEDULE_FILE).read_text())["segments"] == [
        [0, 6], [4, 10], [10, 12]]
    assert _train_records(workdir)[12]["lr"] == 0.0


@pytest.mark.parametrize("key, value", [("model.hidden_size", 32), ("seed", 3),
                                        ("batch_size", 32), ("optimizer.name", "sgd"),
                                        ("model.num_layers", 2)])
def test_keys_that_change_what_a_checkpoint_means_stay_refused(tmp_path, key, value):
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "2").mkdir(parents=True)
    (workdir / config_defaults.CONFIG_FILE).write_text(
        json.dumps(config_defaults.config_dict(syn.tiny_config())))
    with pytest.raises(ValueError, match=rf"holds a run with another config(.|\n)*{key}: "):
        trainer.train(syn.tiny_config(**{key: value, "num_steps": 9}), workdir)
