"""config.profile: a device trace of the chosen training steps (posjax/training/profiler.py)."""
from __future__ import annotations

import gzip
import json
import logging

import pytest

from posjax.training import trainer

import synthetic_runs as syn


def _traces(workdir) -> list:
    return sorted((workdir / "tensorboard" / "plugins" / "profile").glob("*/*.trace.json.gz"))


def _traced_step_calls(trace, step: str = "train_step") -> int:
    """Executions of the compiled ``step`` in a trace (XLA:CPU's PjRt names them so)."""
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sum(1 for e in events
               if e.get("name") == f"CommonPjRtLoadedExecutable::Execute (jit_{step})")


def test_the_chosen_steps_are_traced_into_the_tensorboard_folder(tmp_path, capsys):
    config = syn.tiny_config(**{"profile.first_step": 5, "profile.num_steps": 2})
    trainer.train(config, tmp_path)   # steps 5 and 6, not the final evaluation after them
    [trace] = _traces(tmp_path)
    assert _traced_step_calls(trace) == 2 and _traced_step_calls(trace, "eval_step") == 0
    out = capsys.readouterr().out
    line = (f"profile of steps 5-6 written to {tmp_path / 'tensorboard' / 'plugins' / 'profile'} "
            "(TensorBoard's Profile tab; its *.trace.json.gz opens in Perfetto)")
    assert out.index("step 6/6 ") < out.index(line) < out.index("final eval at step 6")


def test_a_run_stopped_within_the_traced_steps_writes_what_it_traced(tmp_path, capsys):
    config = syn.tiny_config(**{"profile.first_step": 2, "profile.num_steps": 4})
    assert trainer.train(config, tmp_path, stop_after=3).preempted
    [trace] = _traces(tmp_path)
    assert _traced_step_calls(trace) == 2
    assert "profile of steps 2-3 written to " in capsys.readouterr().out


def test_a_resumed_run_past_the_first_traced_step_says_it_traces_nothing(tmp_path, caplog):
    trainer.train(syn.tiny_config(), tmp_path, stop_after=4)   # checkpoints at 2 and 4
    assert not (tmp_path / "tensorboard" / "plugins").exists()   # off by default
    config = syn.tiny_config(**{"profile.first_step": 3, "profile.num_steps": 1})
    with caplog.at_level(logging.WARNING):
        trainer.train(config, tmp_path)   # profile may change on resume: an operational key
    assert "profile: steps 3-3 are not traced, this run starts after step 4" in caplog.text
    assert _traces(tmp_path) == []


def test_a_trace_that_cannot_be_written_is_a_warning_and_training_goes_on(tmp_path, caplog):
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "plugins").write_text("a file where the profile would go")
    config = syn.tiny_config(**{"profile.first_step": 2, "profile.num_steps": 1})
    with caplog.at_level(logging.WARNING):
        result = trainer.train(config, tmp_path)
    assert result.step == config.num_steps and not result.preempted
    assert f"profile: the trace of steps 2-2 could not be written in {tmp_path / 'tensorboard'}" \
        in caplog.text


@pytest.mark.parametrize("overrides, match", [
    ({"profile.num_steps": -1}, r"profile.num_steps=-1 is not valid: must be an integer >= 0"),
    ({"profile.num_steps": True}, r"profile.num_steps=True is not valid"),
    ({"profile.num_steps": 2, "profile.first_step": 0},
     r"profile.first_step=0 is not valid with profile.num_steps=2: the traced steps must be "
     r"steps of the run, 1 … num_steps=6"),
    ({"profile.num_steps": 3, "profile.first_step": 5}, r"profile.first_step=5 is not valid"),
])
def test_a_profile_outside_the_run_is_one_error_before_anything_is_written(
        tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        trainer.train(syn.tiny_config(**overrides), tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_a_misspelt_profile_key_is_refused(tmp_path):
    config = syn.tiny_config()
    config.profile.num_step = 3
    with pytest.raises(ValueError, match=r"unknown config key\(s\) 'profile.num_step'"):
        trainer.train(config, tmp_path / "w")
