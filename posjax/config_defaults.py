"""Defaults of a training config, for configs/*.py and the trainer alike.

Pure: imports only ml_collections and the standard library, so a config file that builds on it
loads without the trainer (orbax, grain). ``default_config`` lists every training key;
``model_defaults`` every field of a model config dataclass.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections


def default_config() -> ml_collections.ConfigDict:
    """Every training key with its default (configs/ override what they need)."""
    return ml_collections.ConfigDict({
        "task": "image_classification",
        "seed": 0,
        "num_steps": 1000,
        "batch_size": 128,           # global, over all processes
        "eval_batch_size": 0,        # 0: batch_size
        "microbatches": 1,           # gradient accumulation: batch split into this many
        "label_smoothing": 0.0,
        "log_every_steps": 50,
        "eval_every_steps": 0,       # 0: evaluate only at the end
        "init_from": "",             # converter output dir (params/ + model_config.json)
                                     # or a train.py workdir (its latest checkpoint's params)
        "peak_flops": 0.0,           # per device, for MFU; 0: table by device kind or measured
        "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
        "optimizer": {"name": "adamw", "learning_rate": 1e-3, "schedule": "cosine",
                      "warmup_steps": 0, "end_learning_rate": 0.0, "b1": 0.9, "b2": 0.999,
                      "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.9, "nesterov": False,
                      "grad_clip_norm": 0.0},
        "checkpoint": {"every_steps": 500, "keep": 3, "async_save": True},
        "profile": {"first_step": 2, "num_steps": 0},   # device trace of steps (profiler.py)
        "distributed": {"enabled": False, "coordinator_address": "", "num_processes": 0,
                        "process_id": -1,
                        "peer_timeout_s": 120},   # a process silent this long: all stop
        "model": {},
        "data": {},
    })


def model_defaults(config_class: type, **overrides: Any) -> dict[str, Any]:
    """Every field of a model config dataclass (ViTConfig, TextConfig) with its default, then
    ``overrides`` — so any field can be set from the command line (--config.model.<field>)."""
    fields = {f.name: f.default for f in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown {config_class.__name__} field(s) {unknown}")
    return {**fields, **overrides}
