"""A run resumed with another ``num_steps``: its learning-rate schedule continues where it was.

The schedule of ``optim.learning_rate_schedule`` depends on ``num_steps`` (the length of its
cosine or linear decay). Rebuilt whole for the new length, it would jump at the resumed step.
Instead a run records its schedule as segments in ``SCHEDULE_FILE`` (``[[0, N0], [s1, N1],
...]``: from step s, decay to ``end_learning_rate`` at step N), written the first time
``num_steps`` changes on resume, and every later resume rebuilds the same piecewise schedule:

* steps before s keep the earlier segments' values (they are already taken);
* from s on, lr(t) = end + (lr(s) − end) · shape((t − s) / (N − s)), t clipped to N, with
  lr(s) the value the earlier segments give at s, shape(x) = (1 + cos πx) / 2 (cosine) or
  1 − x (linear): the curve is continuous at s and ends at ``end_learning_rate`` at N;
* a change at or before the end of the warmup (s ≤ warmup_steps) takes the plain schedule for
  N, which equals the old one up to s.

A constant schedule does not depend on ``num_steps``: no record is needed. Resuming from an
earlier step than a recorded change (a damaged newest step) drops the later segments.
"""
from __future__ import annotations

import json
import logging
import math
import pathlib
from typing import Any, Mapping

import jax.numpy as jnp
import optax

from posjax.io_utils import write_text_atomically
from posjax.training import optim

SCHEDULE_FILE = "lr_schedule.json"
Segments = list[list[int]]


def read_segments(workdir: pathlib.Path) -> Segments | None:
    """The recorded segments; None when the run has none (its schedule is the config's)."""
    path = workdir / SCHEDULE_FILE
    if not path.exists():
        return None
    try:
        segments = json.loads(path.read_text())["segments"]
        if not (segments and all(len(s) == 2 and all(isinstance(v, int) for v in s)
                                 for s in segments)):
            raise ValueError("not a list of [from_step, num_steps]")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is damaged ({e}): it holds the run's learning-rate schedule "
                         "as [[0, num_steps], [resumed step, new num_steps], ...]; restore it "
                         "from a copy") from e
    return segments


def write_segments(workdir: pathlib.Path, segments: Segments) -> None:
    write_text_atomically(workdir / SCHEDULE_FILE, json.dumps({"segments": segments}) + "\n")


def record_original(workdir: pathlib.Path, saved_num_steps: int, num_steps: int,
                    opt: Mapping[str, Any]) -> None:
    """Before a resumed run replaces its ``config.json``: when ``num_steps`` changes a
    decaying schedule and nothing is recorded yet, record the run's schedule so far."""
    if (opt["schedule"] != "constant" and saved_num_steps != num_steps
            and read_segments(workdir) is None):
        write_segments(workdir, [[0, int(saved_num_steps)]])


def extend(segments: Segments, start: int, num_steps: int) -> Segments:
    """``segments`` for a run resumed at ``start`` with ``num_steps``: later segments dropped,
    a new one from ``start`` when the length differs."""
    kept = [s for s in segments if s[0] < start] or segments[:1]
    if kept[-1][1] == num_steps:
        return kept
    return kept + [[int(start), int(num_steps)]]


def _shape(kind: str, x: Any) -> Any:
    return (1 + jnp.cos(math.pi * x)) / 2 if kind == "cosine" else 1 - x


def piecewise_schedule(opt: Mapping[str, Any], segments: Segments) -> optax.Schedule:
    """The schedule of ``segments`` (see the module docstring)."""
    schedule = optim.learning_rate_schedule(opt, segments[0][1])
    end, warmup = float(opt["end_learning_rate"]), int(opt["warmup_steps"])
    for start, num_steps in segments[1:]:
        before = schedule
        if start <= warmup:
            after = optim.learning_rate_schedule(opt, num_steps)
        else:
            at_start = float(before(start))
            length = max(num_steps - start, 1)

            def after(t, at_start=at_start, start=start, length=length):
                x = jnp.clip((t - start) / length, 0.0, 1.0)
                return end + (at_start - end) * _shape(opt["schedule"], x)

        def schedule(t, before=before, after=after, start=start):
            return jnp.where(t >= start, after(t), before(t))
    return schedule


def resumed_schedule(workdir: pathlib.Path, opt: Mapping[str, Any], start: int,
                     num_steps: int, recorded: Segments | None
                     ) -> tuple[optax.Schedule | None, Segments | None]:
    """(schedule, segments to record) for a run resumed at ``start``; (None, None) when the
    config's own schedule holds (nothing recorded, or a constant schedule). ``recorded``:
    ``read_segments`` as process 0 read it. Logs a change of the schedule."""
    if recorded is None or opt["schedule"] == "constant":
        return None, None
    segments = extend(recorded, start, num_steps)
    if segments != recorded:
        old = piecewise_schedule(opt, recorded)
        logging.warning(
            "num_steps %d -> %d changes the learning-rate schedule (%s decay): from step %d it "
            "decays from %.6g (its value there) to end_learning_rate %.6g at step %d "
            "(recorded in %s)", recorded[-1][1], num_steps, opt["schedule"], start,
            float(old(start)), float(opt["end_learning_rate"]), num_steps,
            workdir / SCHEDULE_FILE)
    return piecewise_schedule(opt, segments), segments


def note_resume(workdir: pathlib.Path, saved: dict[str, Any] | None,
                config: Any, changes: list[str]) -> None:
    """Process 0, before a resumed run replaces its ``config.json`` (``saved``): log the keys
    that change (``changes``) and record the schedule so far when ``num_steps`` changes it."""
    if not saved or not changes:
        return
    print("resumed with a changed config (config.json updated): " + "; ".join(changes),
          flush=True)
    if isinstance(saved.get("num_steps"), int):
        record_original(workdir, saved["num_steps"], int(config.num_steps), config.optimizer)


def on_resume(run: Any, start: int) -> Any:
    """``run`` (a ``run_setup.Run``) with the optimizer and schedule of a run resumed at
    ``start`` (``resumed_schedule``); the segments recorded by process 0. Every process
    calls it."""
    import dataclasses

    from posjax.training import processes

    recorded = processes.gather(read_segments(run.workdir) if run.is_main else None)[0]
    if start == 0:   # a fresh start: the config's schedule, and no record of another run
        if run.is_main:
            (run.workdir / SCHEDULE_FILE).unlink(missing_ok=True)
        return run
    config = run.config
    schedule, segments = resumed_schedule(run.workdir, config.optimizer, start,
                                          config.num_steps, recorded)
    if schedule is None:
        return run
    if run.is_main and segments != recorded:
        write_segments(run.workdir, segments)
    from posjax.training import steps

    program = steps.build_training(config, run.mesh, run.task, schedule)
    return dataclasses.replace(run, tx=program.tx, schedule=program.schedule,
                               train_step=program.train_step)
