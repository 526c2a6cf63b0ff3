"""Optimizers and learning-rate schedules from ``config.optimizer``.

Keys: ``name`` (adamw | sgd), ``learning_rate`` (peak), ``schedule`` (cosine | linear |
constant), ``warmup_steps``, ``end_learning_rate``, ``b1``, ``b2``, ``eps`` (AdamW),
``momentum``, ``nesterov`` (SGD), ``weight_decay``, ``grad_clip_norm`` (0 = no clipping).

lr(t) = peak · t / warmup for t < warmup, then decays from peak to ``end_learning_rate`` over
the remaining ``num_steps − warmup`` steps (cosine: end + (peak − end)(1 + cos(π s))/2,
linear: peak + (end − peak) s, with s the decay progress in [0, 1]).

Weight decay (decoupled for AdamW, coupled L2 for SGD) applies to every parameter except
biases and normalisation scales/offsets (leaves named ``bias`` or ``scale``).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import optax

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
    ``learning_rate_schedule`` (a resumed run's, ``schedule_extension``)."""
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
