"""The run config: which keys exist (``config_defaults.default_config``), their validation,
and how two configs are compared (``config_differences``: the keys that may change on resume
or evaluation are free; a saved config's model section with its defaults filled in). The
config a run saved in its workdir is read by ``config_defaults.load_saved_config``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import ml_collections

from posjax import config_defaults
from posjax.models.config import check
from posjax.models import params as params_lib
from posjax.training import optim, profiler, stop_request
from posjax.training.tasks import make_task


# Keys that may change between a run and its resumption: they change neither the math nor the
# saved state. eval_batch_size only says how the test split is batched (padding rows are
# dropped); init_from only seeds a run that starts without a checkpoint; model.remat,
# model.gather, model.attention_impl and model.pallas_interpret only say how the same model
# is computed (recomputed activations, DeBERTa's relative-position strategy, the attention
# path and kernel). data.worker_count is not one: Grain saves another input-iterator
# state with worker processes than without; nor is model.scan_layers (another parameter layout).
# data_root only seeds the recipes' data paths, which are compared themselves. eval_step only
# says which saved step eval.py reads (train.py refuses it: run_setup.prepare). preemption only
# says how a coming stop is noticed (the GCE maintenance event).
OPERATIONAL_KEYS = ("mesh", "checkpoint", "log_every_steps", "eval_every_steps", "peak_flops",
                    "eval_batch_size", "distributed", "init_from", "model.remat", "model.gather",
                    "model.attention_impl", "model.pallas_interpret", "profile", "data_root",
                    "eval_step", "preemption")


# Keys a resumed run may change besides OPERATIONAL_KEYS: its length (a decaying learning-rate
# schedule continues from the resumed step's value, ``optim.resumed_schedule``).
RESUME_KEYS = OPERATIONAL_KEYS + ("num_steps",)


# Keys eval.py may set differently from the run's config.json besides OPERATIONAL_KEYS: how and
# from where evaluation reads its data, and at which text length (length extrapolation:
# relative schemes at any length; an absolute table has no rows beyond its own, which
# text_tasks.validate_model refuses unless model.extend_positions says how to extend it).
# Every other key defines the model or its saved state.
EVAL_KEYS = OPERATIONAL_KEYS + ("num_steps", "batch_size", "microbatches", "data.path",
                                "data.data_dir", "data.glue_dir", "data.text_files",
                                "data.tokenizer", "data.train_split", "data.test_split",
                                "data.worker_count", "data.max_seq_length",
                                "model.extend_positions")


# The EVAL_KEYS that say which data is read. An evaluation on other data than the run's
# (config.json) writes its results under their own names (``eval_tag``), never over the run's.
DATA_SOURCE_KEYS = ("data.path", "data.data_dir", "data.glue_dir", "data.text_files",
                    "data.tokenizer")


def check_known_keys(config: ml_collections.ConfigDict) -> None:
    """Every key (top level, optimizer, checkpoint, profile, distributed, preemption) must be
    one config_defaults.default_config defines: a misspelt key in a config file would
    otherwise be ignored silently."""
    defaults = config_defaults.default_config()
    problems = [f"{k!r}" for k in sorted(set(config) - set(defaults))]
    for group in ("optimizer", "checkpoint", "profile", "distributed", "preemption"):
        if group in config:
            extra = sorted(set(config[group]) - set(defaults[group]))
            problems += [f"'{group}.{k}'" for k in extra]
    if problems:
        raise ValueError(f"unknown config key(s) {', '.join(problems)}: the training config has "
                         "no such field (see posjax.config_defaults.default_config)")


def validate_training_config(config: ml_collections.ConfigDict) -> None:
    """Scalar training keys (the task, optimizer and data check their own)."""
    check_known_keys(config)
    for key in ("num_steps", "batch_size", "microbatches", "log_every_steps"):
        v = config[key]
        check(isinstance(v, int) and v > 0,
              f"{key}={v!r} is not valid: must be a positive integer")
    for key in ("eval_batch_size", "eval_every_steps"):
        v = config[key]
        check(isinstance(v, int) and v >= 0,
              f"{key}={v!r} is not valid: must be an integer >= 0 (0 = default)")
    check(config.checkpoint.every_steps > 0, f"checkpoint.every_steps="
          f"{config.checkpoint.every_steps!r} is not valid: must be > 0")
    check(config.checkpoint.keep >= 0, f"checkpoint.keep={config.checkpoint.keep!r} is not "
          "valid: must be >= 0 (0 keeps all)")
    check(0 <= config.peak_flops < math.inf, f"peak_flops={config.peak_flops!r} is not valid: "
          "must be a finite number >= 0 (0 = default)")
    optim.validate(config.optimizer, config.num_steps)
    profiler.validate(config.profile, config.num_steps)
    stop_request.validate(config.get("preemption") or {})


def flatten(config: dict[str, Any]) -> dict[str, Any]:
    """{dotted key (``data.text_files.valid``): value} of a config dict."""
    return {".".join(path): v for path, v in params_lib.flatten(config).items()}


def flattened(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """``flatten`` of the config as plain data (``config_defaults.config_dict``)."""
    return flatten(config_defaults.config_dict(config))


def under(key: str, sections: tuple[str, ...]) -> bool:
    """Whether the flat ``key`` is one of ``sections`` or lies under one (``data.text_files``
    holds ``data.text_files.valid``)."""
    return any(key == s or key.startswith(s + ".") for s in sections)


def config_differences(saved: dict[str, Any], current: dict[str, Any],
                       free: tuple[str, ...] = OPERATIONAL_KEYS) -> list[str]:
    """'key: saved -> current' for every key that differs, ignoring the keys in ``free`` (and
    everything under them)."""
    a, b = flatten(saved), flatten(current)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b)) if not under(k, free) and a.get(k) != b.get(k)]


def with_model_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its ``model`` section as the task's model config resolves it (every field,
    defaults filled in): a run saved before its recipe listed every field then compares equal to
    the same run listing the defaults. The defaults are today's, so a changed default does not
    show against an old run that left the field out. Unchanged when the task or model cannot be
    resolved (the raw sections are compared then)."""
    try:
        model = make_task(ml_collections.ConfigDict(config)).model_config
    except (ValueError, TypeError, AttributeError):
        return config
    return {**config, "model": json.loads(json.dumps(dataclasses.asdict(model)))}


