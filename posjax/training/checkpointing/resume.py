"""The newest intact step (``restore_newest_intact``): the one algorithm by which a training run
resumes and eval.py picks the step it evaluates.

The saved steps are tried newest first. A step that cannot be restored (files missing or cut
short, bytes that do not match its integrity record, unreadable metadata, another tree than the
model's, non-finite values) is passed over, with one warning naming what was wrong, and the
next older step is tried: a training run moves it aside (``integrity.move_aside``:
``<step>.damaged-<reason>``, never deleted), eval.py leaves it where it is (a run may be
training in the workdir). Only when no step is intact does it stop, with the newest step's
error, and then nothing is renamed (an unmounted or failing storage is not taken for damage of
every step). The newest step holding another tree than the model's is the config's fault, not
the checkpoints': it is raised at once. Every process takes the same decision: each one's
outcome is gathered, and a step fails when it fails on any process; process 0 alone renames.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import jax

from posjax.training import hosts
from posjax.training import state as state_lib
from posjax.training.checkpointing import integrity
from posjax.training.checkpointing.checkpointer import Checkpointer, DamagedStep


def _attempt(checkpointer: Checkpointer, step: int, abstract: Any,
             data_iter: Any) -> tuple[Any, DamagedStep | None]:
    """(state, None) or (None, the step's damage), the same on every process."""
    state, damage = None, None
    try:
        state = checkpointer.restore(step, abstract, data_iter)
    except DamagedStep as e:
        damage = e
    if damage is None and not state_lib.all_finite(state):
        damage = DamagedStep(
            step, "non-finite", f"checkpoint {checkpointer.directory / str(step)} holds "
            "non-finite values (NaN or inf) in its state")
    if hosts.several():   # a step is damaged when it is on any process: the first one's
        mine = None if damage is None else [damage.reason, str(damage)]
        first = next((s for s in hosts.gather(mine) if s is not None), None)
        if first is not None and first != mine:
            damage = DamagedStep(step, first[0], first[1])
    return (None, damage) if damage is not None else (state, None)


def restore_newest_intact(checkpointer: Checkpointer, abstract: Any, data_iter: Any | None,
                          move: bool = True, start: int | None = None,
                          fall_back: bool = True, gone: Callable[[int], bool] | None = None
                          ) -> tuple[Any, int] | None:
    """(state, step) of the newest step that restores intact; None when there is no step.

    The steps tried: process 0's listing, newest first; from ``start`` on (eval.py's step,
    tried whether listed or not) when given. A damaged step is passed over when ``fall_back``
    (else its ``DamagedStep`` is raised), and moved aside when ``move`` (a training run;
    eval.py only skips it); the warning names the step used instead. ``gone(step)``, asked of
    process 0 for a damaged step: it was removed while it was read (a run's
    ``checkpoint.keep``), and its ``DamagedStep`` is raised at once, for the caller to list the
    steps again. Raises the newest step's ``DamagedStep`` when none is intact, and any other
    error (another process count) at once."""
    listed = sorted(hosts.gather(checkpointer.manager.all_steps())[0], reverse=True)
    steps = listed if start is None else [start] + [s for s in listed if s < start]
    damaged: list[DamagedStep] = []
    for step in steps:
        state, damage = _attempt(checkpointer, step, abstract, data_iter)
        if damage is None:
            _set_aside(checkpointer, damaged, step, move)
            return state, step
        if (not fall_back or (not damaged and damage.reason == "wrong-tree")
                or (gone is not None and hosts.process_0_view(lambda: gone(step)))):
            raise damage
        damaged.append(damage)
    if not damaged:
        return None
    newest, older = damaged[0], damaged[1:]
    if not older:
        raise newest
    raise DamagedStep(newest.step, newest.reason, f"{newest}. No older step is intact either ("
                      + ", ".join(f"step {d.step}: {d.reason}" for d in older) + ")") from newest


def damage_only(damage: DamagedStep) -> str:
    """The damage ``damage`` names, without the way out (which step to use instead)."""
    return str(damage).split(". If it is damaged")[0]


def _set_aside(checkpointer: Checkpointer, damaged: list[DamagedStep], intact: int,
               move: bool) -> None:
    """One warning per damaged step newer than ``intact``; moved aside when ``move``."""
    for damage in damaged:
        if move:
            where = checkpointer.directory / str(damage.step)
            if jax.process_index() == 0:
                where = integrity.move_aside(where, damage.reason)
            logging.warning("%s; moved aside to %s; using step %d instead", damage_only(damage),
                            where, intact)
        else:
            logging.warning("%s; evaluating step %d instead", damage_only(damage), intact)
    if damaged:
        if hosts.several():
            hosts.gather(0)   # every process lists after process 0 renamed
        checkpointer.manager.reload()
