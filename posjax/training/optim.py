"""Optimizers and learning-rate schedules from ``config.optimizer``.

Keys: ``name`` (adamw | sgd), ``learning_rate`` (peak), ``schedule`` (cosine | linear |
constant), ``warmup_steps``, ``end_learning_rate``, ``b1``, ``b2``, ``eps`` (AdamW),
``momentum``, ``nesterov`` (SGD), ``weight_decay``, ``grad_clip_norm`` (0 = no clipping).

lr(t) = peak · t / warmup for t < warmup, then decays from peak to ``end_learning_rate`` over
the remaining ``num_steps − warmup`` steps (cosine: end + (peak − end)(1 + cos(π s))/2,
linear: peak + (end − peak) s, with s the decay progress in [0, 1]).

Weight decay (decoupled for AdamW, coupled L2 for SGD) applies to every parameter except
biases and normalisation scales/offsets (leaves named ``bias`` or ``scale``).

A run resumed with another ``num_steps``: its learning-rate schedule continues where it was.
The schedule of ``learning_rate_schedule`` depends on ``num_steps`` (the length of its cosine
or linear decay). Rebuilt whole for the new length, it would jump at the resumed step. Instead
a run records its schedule as segments in ``SCHEDULE_FILE`` (``[[0, N0], [s1, N1], ...]``:
from step s, decay to ``end_learning_rate`` at step N), written the first time ``num_steps``
changes on resume (``run_setup.note_resume``), and every later resume rebuilds the same
piecewise schedule (``run_setup.on_resume``, ``resumed_schedule``):

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

import jax
import jax.numpy as jnp
import optax

from posjax.io_utils import write_text_atomically

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "linear", "constant")
NO_DECAY_NAMES = ("bias", "scale")


def validate(opt: Mapping[str, Any], num_steps: int) -> None:
    """Raise one ValueError naming the bad ``optimizer.*`` field."""
    def bad(field: str, fix: str) -> ValueError:
        return ValueError(f"optimizer.{field}={opt.get(field)!r} is not valid: {fix}")

    for field, value in opt.items():   # a NaN passes every comparison below as False
        if isinstance(value, float) and not math.isfinite(value):
            raise bad(field, "must be a finite number")
    if opt["name"] not in OPTIMIZERS:
        raise bad("name", f"choose one of {', '.join(OPTIMIZERS)}")
    if opt["schedule"] not in SCHEDULES:
        raise bad("schedule", f"choose one of {', '.join(SCHEDULES)}")
    if not opt["learning_rate"] > 0:
        raise bad("learning_rate", "must be > 0")
    if not 0 <= opt["warmup_steps"] < max(num_steps, 1):
        raise bad("warmup_steps", f"must lie in [0, num_steps={num_steps})")
    if opt["end_learning_rate"] < 0:
        raise bad("end_learning_rate", "must be >= 0")
    if opt["weight_decay"] < 0:
        raise bad("weight_decay", "must be >= 0")
    if opt["grad_clip_norm"] < 0:
        raise bad("grad_clip_norm", "must be >= 0 (0 disables clipping)")
    if opt["name"] == "adamw":
        for beta in ("b1", "b2"):
            if not 0 <= opt[beta] < 1:
                raise bad(beta, "must lie in [0, 1)")
        if not opt["eps"] > 0:
            raise bad("eps", "must be > 0")
    if opt["name"] == "sgd" and not 0 <= opt["momentum"] < 1:
        raise bad("momentum", "must lie in [0, 1)")
    if opt["name"] == "sgd" and opt["nesterov"] and not opt["momentum"] > 0:
        raise bad("nesterov", "needs momentum > 0 (set optimizer.momentum, e.g. 0.9)")


def learning_rate_schedule(opt: Mapping[str, Any], num_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine / linear decay or constant."""
    peak, warmup = float(opt["learning_rate"]), int(opt["warmup_steps"])
    end = float(opt["end_learning_rate"])
    decay_steps = max(num_steps - warmup, 1)
    if opt["schedule"] == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=end / peak)
    elif opt["schedule"] == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay (not biases, not norm scales/offsets)."""
    def decays(path, _):
        last = path[-1]
        name = getattr(last, "key", getattr(last, "name", str(last)))
        return name not in NO_DECAY_NAMES
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(opt: Mapping[str, Any], num_steps: int,
                   schedule: optax.Schedule | None = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(clip ∘ optimizer, schedule) for ``config.optimizer``; ``schedule``: another one than
    ``learning_rate_schedule`` (a resumed run's, ``resumed_schedule``)."""
    schedule = schedule or learning_rate_schedule(opt, num_steps)
    parts = []
    if opt["grad_clip_norm"] > 0:
        parts.append(optax.clip_by_global_norm(float(opt["grad_clip_norm"])))
    if opt["name"] == "adamw":
        parts.append(optax.adamw(schedule, b1=float(opt["b1"]), b2=float(opt["b2"]),
                                 eps=float(opt["eps"]), weight_decay=float(opt["weight_decay"]),
                                 mask=decay_mask))
    else:
        if opt["weight_decay"] > 0:
            parts.append(optax.add_decayed_weights(float(opt["weight_decay"]), mask=decay_mask))
        parts.append(optax.sgd(schedule, momentum=float(opt["momentum"]) or None,
                               nesterov=bool(opt["nesterov"])))
    return optax.chain(*parts), schedule


# -- a run resumed with another num_steps (the module docstring) ----------------------------

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
    schedule = learning_rate_schedule(opt, segments[0][1])
    end, warmup = float(opt["end_learning_rate"]), int(opt["warmup_steps"])
    for start, num_steps in segments[1:]:
        before = schedule
        if start <= warmup:
            after = learning_rate_schedule(opt, num_steps)
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
