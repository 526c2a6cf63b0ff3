"""``checkpointing.resume.restore_newest_intact``, the one newest-intact-step algorithm of a
training run's resume and of eval.py, on a stand-in checkpointer (no Orbax, no training): which
steps it tries, what it passes over, moves aside and raises. The real runs are in
test_checkpoint_fallback.py."""
from __future__ import annotations

import logging
import pathlib
import re
import types

import numpy as np
import pytest

from posjax.training.checkpointing import resume
from posjax.training.checkpointing.checkpointer import DamagedStep

WAY_OUT = ". If it is damaged (a full disk, an interrupted copy), move it out"


class StandIn:
    """A checkpointer whose steps restore as ``outcomes`` say: a reason (damaged), "nan" (a
    state with a NaN) or nothing (intact)."""

    def __init__(self, directory: pathlib.Path, outcomes: dict[int, str | None]):
        self.directory = directory / "checkpoints"
        for step in outcomes:
            (self.directory / str(step)).mkdir(parents=True)
        self.outcomes, self.tried, self.reloads = outcomes, [], 0
        self.manager = types.SimpleNamespace(all_steps=lambda: sorted(outcomes),
                                             reload=self._reload)

    def _reload(self) -> None:
        self.reloads += 1

    def restore(self, step, abstract, data_iter=None):
        self.tried.append(step)
        outcome = self.outcomes[step]
        if outcome is None or outcome == "nan":
            return {"w": np.full(2, np.nan if outcome else float(step), np.float32)}
        raise DamagedStep(step, outcome, f"checkpoint {self.directory / str(step)} cannot be "
                          f"restored ({outcome}){WAY_OUT}")


def test_the_newest_intact_step_is_used_and_the_damaged_newer_ones_moved_aside(tmp_path,
                                                                                caplog):
    stand_in = StandIn(tmp_path, {2: None, 4: "truncated", 6: "nan"})
    with caplog.at_level(logging.WARNING):
        state, step = resume.restore_newest_intact(stand_in, None, None)
    assert step == 2 and state["w"][0] == 2.0 and stand_in.tried == [6, 4, 2]
    assert sorted(p.name for p in stand_in.directory.iterdir()) == [
        "2", "4.damaged-truncated", "6.damaged-non-finite"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all(w.endswith("; using step 2 instead") for w in warnings)
    assert "moved aside to" in warnings[0] and WAY_OUT not in warnings[0]
    assert stand_in.reloads == 1


def test_eval_skips_without_moving_and_starts_at_its_step(tmp_path, caplog):
    stand_in = StandIn(tmp_path, {2: None, 4: "checksum", 6: None})
    with caplog.at_level(logging.WARNING):
        _, step = resume.restore_newest_intact(stand_in, None, None, move=False, start=4)
    assert step == 2 and stand_in.tried == [4, 2]
    assert sorted(p.name for p in stand_in.directory.iterdir()) == ["2", "4", "6"]
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {stand_in.directory / '4'} cannot be restored (checksum); evaluating step "
        "2 instead"]


def test_a_step_asked_for_is_not_fallen_back_from(tmp_path):
    stand_in = StandIn(tmp_path, {2: None, 4: "missing"})
    with pytest.raises(DamagedStep) as raised:
        resume.restore_newest_intact(stand_in, None, None, move=False, start=4, fall_back=False)
    assert raised.value.step == 4 and stand_in.tried == [4]


def test_another_tree_at_the_newest_step_is_raised_at_once(tmp_path):
    stand_in = StandIn(tmp_path, {2: None, 4: "wrong-tree"})
    with pytest.raises(DamagedStep, match=r"\(wrong-tree\)") as raised:
        resume.restore_newest_intact(stand_in, None, None)
    assert raised.value.reason == "wrong-tree" and stand_in.tried == [4]
    assert (stand_in.directory / "4").is_dir()


def test_a_step_gone_meanwhile_is_raised_for_the_caller_to_list_again(tmp_path):
    stand_in = StandIn(tmp_path, {2: None, 4: "unreadable", 6: "truncated"})
    with pytest.raises(DamagedStep) as raised:
        resume.restore_newest_intact(stand_in, None, None, move=False,
                                     gone=lambda step: step == 4)
    assert raised.value.step == 4 and stand_in.tried == [6, 4]


def test_no_intact_step_is_the_newest_error_naming_the_older_ones_and_nothing_moves(tmp_path):
    stand_in = StandIn(tmp_path, {2: "missing", 4: "truncated"})
    with pytest.raises(DamagedStep, match=r"^checkpoint .*/4 cannot be restored \(truncated\)"
                                          rf"{re.escape(WAY_OUT)}\. No older step is intact either "
                                          r"\(step 2: missing\)$"):
        resume.restore_newest_intact(stand_in, None, None)
    assert sorted(p.name for p in stand_in.directory.iterdir()) == ["2", "4"]
    one = StandIn(tmp_path / "one", {4: "truncated"})
    with pytest.raises(DamagedStep, match=r"\(truncated\)\. If it is damaged") as raised:
        resume.restore_newest_intact(one, None, None)
    assert "No older step" not in str(raised.value)


def test_no_step_at_all_is_none(tmp_path):
    assert resume.restore_newest_intact(StandIn(tmp_path, {}), None, None) is None
