"""config.profile: a device trace of the chosen training steps (posjax/training/profiler.py)."""
from __future__ import annotations

import gzip
import json
import logging

import pytest

from posjax.training import loop

import test_training_synthetic as syn


def _traces(workdir) -> list:
    return sorted((workdir / "tensorboard" / "plugins" / "profile").glob("*/*.trace.json.gz"))


def _traced_step_calls(trace) -> int:
    """Executions of the compiled train step in a trace (XLA:CPU's PjRt names them so)."""
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sum(1 for e in events
               if e.get("name") == "CommonPjRtLoadedExecutable::Execute (jit_train_step)")


def test_the_chosen_steps_are_traced_into_the_tensorboard_folder(tmp_path, capsys):
    config = syn.tiny_config(**{"profile.first_step": 3, "profile.num_steps": 2})
    loop.train(config, tmp_path)
    [trace] = _traces(tmp_path)
    assert _traced_step_calls(trace) == 2
    out = capsys.readouterr().out
    line = (f"profile of steps 3-4 written to {tmp_path / 'tensorboard' / 'plugins' / 'profile'} "
            "(TensorBoard's Profile tab; its *.trace.json.gz opens in Perfetto)")
    assert out.index("step 4/6 ") < out.index(line) < out.index("step 5/6 ")


def test_a_run_stopped_within_the_traced_steps_writes_what_it_traced(tmp_path, capsys):
    config = syn.tiny_config(**{"profile.first_step": 2, "profile.num_steps": 4})
    assert loop.train(config, tmp_path, stop_after=3).preempted
    [trace] = _traces(tmp_path)
    assert _traced_step_calls(trace) == 2
    assert "profile of steps 2-3 written to " in capsys.readouterr().out


def test_a_resumed_run_past_the_first_traced_step_says_it_traces_nothing(tmp_path, caplog):
    loop.train(syn.tiny_config(), tmp_path, stop_after=4)   # checkpoints at 2 and 4
    assert not (tmp_path / "tensorboard" / "plugins").exists()   # off by default
    config = syn.tiny_config(**{"profile.first_step": 3, "profile.num_steps": 1})
    with caplog.at_level(logging.WARNING):
        loop.train(config, tmp_path)   # profile may change on resume: an operational key
    assert "profile: steps 3-3 are not traced, this run starts after step 4" in caplog.text
    assert _traces(tmp_path) == []


@pytest.mark.parametrize("overrides, match", [
    ({"profile.num_steps": -1}, r"profile.num_steps=-1 is not valid: must be an integer >= 0"),
    ({"profile.num_steps": 2, "profile.first_step": 0},
     r"profile.first_step=0 is not valid: must be a step of the run, 1 … num_steps=6"),
    ({"profile.num_steps": 2, "profile.first_step": 7}, r"profile.first_step=7 is not valid"),
])
def test_a_profile_outside_the_run_is_one_error_before_anything_is_written(
        tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        loop.train(syn.tiny_config(**overrides), tmp_path / "w")
    assert not (tmp_path / "w").exists()
