"""Resuming from the newest intact step (``restore_newest_intact``).

A step that cannot be restored (files missing or cut short, bytes that do not match its
integrity record, unreadable metadata, another tree than the model's, non-finite values) is
moved aside (``integrity.move_aside``: ``<step>.damaged-<reason>``, never deleted), with one
warning naming what was wrong, and the next older step is tried. Only when no step is intact
does the resume stop, with the newest step's error, and then nothing is renamed (an unmounted
or failing storage is not taken for damage of every step). Every process takes the same
decision: each one's outcome is gathered, and a step fails when it fails on any process;
process 0 alone renames.
"""
from __future__ import annotations

import logging
from typing import Any

import jax

from posjax.training import checkpoint as ckpt_lib
from posjax.training import integrity
from posjax.training import processes
from posjax.training import state as state_lib


def _attempt(checkpointer: ckpt_lib.Checkpointer, step: int, abstract: Any,
             data_iter: Any) -> tuple[Any, ckpt_lib.DamagedStep | None]:
    """(state, None) or (None, the step's damage), the same on every process."""
    state, damage = None, None
    try:
        state = checkpointer.restore(step, abstract, data_iter)
    except ckpt_lib.DamagedStep as e:
        damage = e
    if damage is None and not state_lib.all_finite(state):
        damage = ckpt_lib.DamagedStep(
            step, "non-finite", f"checkpoint {checkpointer.directory / str(step)} holds "
            "non-finite values (NaN or inf) in its state")
    if processes.several():   # a step is damaged when it is on any process
        seen = processes.gather(None if damage is None else [damage.reason, str(damage)])
        first = next((s for s in seen if s is not None), None)
        if first is not None and damage is None:
            damage = ckpt_lib.DamagedStep(step, first[0], first[1])
    return (None, damage) if damage is not None else (state, None)


def restore_newest_intact(checkpointer: ckpt_lib.Checkpointer, abstract: Any,
                          data_iter: Any | None, move: bool = True) -> tuple[Any, int] | None:
    """(state, step) of the newest step that restores intact; None when there is no step.
    Newer damaged steps are moved aside when ``move`` (a training run; eval.py only skips
    them, warning). Raises the newest step's ``DamagedStep`` when none is intact, and any
    other error (another process count) at once."""
    steps = sorted(processes.gather(checkpointer.manager.all_steps())[0], reverse=True)
    damaged: list[ckpt_lib.DamagedStep] = []
    for step in steps:
        state, damage = _attempt(checkpointer, step, abstract, data_iter)
        if damage is None:
            _set_aside(checkpointer, damaged, step, move)
            return state, step
        damaged.append(damage)
    if not damaged:
        return None
    if all(d.reason == "wrong-tree" for d in damaged):
        raise damaged[0]   # the config's model, not the checkpoints
    newest, older = damaged[0], damaged[1:]
    if not older:
        raise newest
    raise ckpt_lib.DamagedStep(newest.step, newest.reason, f"{newest}. No older step is intact "
                               "either (" + ", ".join(f"step {d.step}: {d.reason}"
                                                      for d in older) + ")") from newest


def _set_aside(checkpointer: ckpt_lib.Checkpointer, damaged: list[ckpt_lib.DamagedStep],
               intact: int, move: bool) -> None:
    """One warning per damaged step newer than ``intact``; moved aside when ``move``."""
    for damage in damaged:
        where = checkpointer.directory / str(damage.step)
        if move and jax.process_index() == 0:
            where = integrity.move_aside(where, damage.reason)
        first_line = str(damage).split(". If it is damaged")[0]
        logging.warning("%s; %s; using step %d instead", first_line,
                        f"moved aside to {where}" if move else "skipped", intact)
    if damaged:
        if processes.several():
            processes.gather(0)   # every process lists after process 0 renamed
        checkpointer.manager.reload()
