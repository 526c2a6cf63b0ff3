"""Defaults of a training config, for configs/*.py and the trainer alike.

Imports only ml_collections, the standard library and the model config dataclasses
(``posjax.models.config``), so a config file that builds on it loads without the trainer
(orbax, grain, posjax.training). ``default_config`` lists every training key;
``model_defaults`` every field of a model config dataclass; ``image_data_config``,
``mlm_data_config`` and ``glue_data_config`` every data key of each task; ``data_root`` where
the recipes' data lies; ``variant_values`` reads a config file's variant string
(``configs/glue_tiny.py:task=sst2,scheme=deberta``); ``load_saved_config`` the config a run
saved in its workdir (``CONFIG_FILE``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Mapping

import ml_collections
from ml_collections.config_dict import FieldReference

from posjax import storage
from posjax.io_utils import read_json_object
from posjax.models.config import TextConfig, ViTConfig
from posjax.models.schemes import ALIASES, SCHEMES, TEXT_SCHEMES, Scheme

DATA_ENV = "POSJAX_DATA"
CONFIG_FILE = "config.json"   # a run's config, in its workdir


def data_root() -> str:
    """Where the recipes' data lies: ``$POSJAX_DATA`` when set, else ``shared/data`` beside
    the repository (``../shared/data``: the default for tests and CI)."""
    return os.environ.get(DATA_ENV) or str(
        pathlib.Path(__file__).resolve().parents[2] / "shared" / "data")


def default_config() -> ml_collections.ConfigDict:
    """Every training key with its default (configs/ override what they need)."""
    return ml_collections.ConfigDict({
        "task": "image_classification",
        "seed": 0,
        "data_root": data_root(),    # recipes derive their data paths from it (references)
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
        "eval_step": eval_step_field(),   # eval.py only: the step to evaluate; None: the
                                          # newest intact step
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
        # The GCE maintenance-event notice (Cloud TPU VMs): polled, it stops the run as a
        # SIGTERM does. "auto": poll when the JAX backend is TPU; "on"; "off".
        "preemption": {"poll_maintenance_event": "auto", "poll_seconds": 5.0},
        "model": {},
        "data": {},
    })


def eval_step_field(value: Any = None) -> FieldReference:
    """``eval_step`` as a field any ``--config.eval_step=V`` may set (a plain None field
    cannot be overridden from the command line): V is read as a Python literal, so that
    eval.py, not the flag parser, says what is wrong with a value that is not a step."""
    return FieldReference(value, field_type=object)


def model_defaults(config_class: type, **overrides: Any) -> dict[str, Any]:
    """Every field of a model config dataclass (ViTConfig, TextConfig) with its default, then
    ``overrides`` — so any field can be set from the command line (--config.model.<field>)."""
    fields = {f.name: f.default for f in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown {config_class.__name__} field(s) {unknown}")
    return {**fields, **overrides}


def vit_model(**overrides: Any) -> dict[str, Any]:
    """``model_defaults`` of ViTConfig."""
    return model_defaults(ViTConfig, **overrides)


# The text recipes' scheme names (configs/mlm_<name>.py): each text scheme's short alias
# (bert_a for bert_abs) or its name, in the scheme table's order.
RECIPE_SCHEMES = tuple(SCHEMES[n].alias or n for n in TEXT_SCHEMES)


def recipe_scheme(name: str) -> Scheme:
    """The scheme table's row for a recipe's scheme name (an alias such as bert_a, or a text
    scheme's own name); one ValueError listing the choices otherwise."""
    full = ALIASES.get(name, name)
    if full not in TEXT_SCHEMES:
        raise ValueError(f"scheme {name!r} is unknown: choose one of {', '.join(RECIPE_SCHEMES)}")
    return SCHEMES[full]


def text_model(**overrides: Any) -> dict[str, Any]:
    """``model_defaults`` of TextConfig."""
    return model_defaults(TextConfig, **overrides)


def image_data_config(name: str = "digits") -> ml_collections.ConfigDict:
    """Every image data key with the defaults for ``name`` (posjax.data.images validates)."""
    channels = 1 if name in ("digits", "mnist") else 3
    natural = name in ("cifar10", "image_folder", "tfds")
    return ml_collections.ConfigDict({
        "name": name,
        "path": "",
        "tfds_name": "",
        "data_dir": "",
        "train_split": "train_20k" if name == "cifar10" else "train",
        "test_split": "test",
        "image_size": {"digits": 8, "mnist": 28, "cifar10": 32}.get(name, 224),
        "random_resized_crop": natural,
        "crop_scale": (0.08, 1.0) if name in ("image_folder", "tfds") else (0.25, 1.0),
        "crop_ratio": (3 / 4, 4 / 3),
        "flip": natural,
        "mixup_alpha": 0.0,
        "mean": (0.5,) * channels,
        "std": (0.5,) * channels,
        "worker_count": 0,
    })


def mlm_data_config() -> ml_collections.ConfigDict:
    """Every MLM data key with its default (see posjax.data.text)."""
    return ml_collections.ConfigDict({
        "source": "text_files",
        "text_files": {"train": ""},
        "doc_boundary": "blank_line",
        "tfds_name": "",
        "data_dir": "",
        "text_key": "text",
        "train_split": "train",
        "test_split": "train",
        "tokenizer": "",
        "lowercase": True,
        "unk_marker": "",
        "max_seq_length": 128,
        "mask_rate": 0.15,
        "max_predictions": 0,
        "whole_word": False,
        "mask_token_rate": 0.8,
        "random_token_rate": 0.1,
    })


def glue_data_config(task: str = "sst2") -> ml_collections.ConfigDict:
    """Every GLUE data key with its default (see posjax.data.glue, which validates)."""
    return ml_collections.ConfigDict({
        "task": task,
        "glue_dir": "",
        "data_dir": "",
        "train_split": "train",
        "test_split": "validation_matched" if task == "mnli" else "validation",
        "tokenizer": "",
        "lowercase": True,
        "max_seq_length": 128,
    })


def variant_values(variant: str, keys: Mapping[str, str], where: str, *,
                   aliases: Mapping[str, Mapping[str, str]] | None = None,
                   whole: bool = False) -> dict[str, str]:
    """The values of ``keys`` ({name: default}) that the variant string of the config file
    ``where`` gives: ``key=value`` items separated by commas (``task=sst2,scheme=deberta``).
    The older spellings still work: bare values in the order of ``keys`` (``sst2,deberta``;
    never ``data_root``)
    and the bare names in ``aliases`` (``tiny`` -> ``{"size": "tiny"}``). ``whole``: the
    variant is one value (a path may hold commas or ``=``), ``key=value`` for its first key
    only. An unknown key, or more bare values than keys, is one ValueError."""
    values = dict(keys)
    names = list(keys)
    positional = [k for k in names if k != "data_root"]   # data_root: key=value only
    if not variant:
        return values
    items = [variant] if whole else [item.strip() for item in variant.split(",")]
    bare = 0
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if eq and not (whole and key not in keys):
            if key not in keys:
                raise ValueError(
                    f"{where}: unknown variant key {key!r} in {variant!r}; its keys are "
                    f"{', '.join(names) or 'none'} (key=value items separated by commas)")
            values[key] = value.strip()
        elif aliases and item in aliases:
            values.update(aliases[item])
        else:
            if bare >= len(positional):
                raise ValueError(f"variant {variant!r} is unknown: {where} takes "
                                 + (f"key=value items with keys {', '.join(names)}" if names
                                    else "no variant"))
            values[positional[bare]] = item
            bare += 1
    return values


def root_path(config: ml_collections.ConfigDict, *parts: str) -> Any:
    """``config.data_root``/``parts`` as a reference: it follows ``--config.data_root``
    until the path itself is set."""
    path = config.get_ref("data_root")
    for part in parts:
        path = path + "/" + part
    return path


def config_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config as plain JSON-compatible data (tuples become lists)."""
    return json.loads(config.to_json())


def read_saved_config(workdir: str | pathlib.Path) -> dict[str, Any] | None:
    """The run's ``config.json`` as a dict; None when the workdir has none."""
    return read_json_object(storage.as_path(workdir, "--workdir") / CONFIG_FILE,
                            "the run's config", "restore it from a copy, or use a new --workdir")


def load_saved_config(workdir: str | pathlib.Path) -> ml_collections.ConfigDict:
    """The config a train.py run saved in ``workdir`` (its ``config.json``); a key it lacks
    (saved before the key existed) takes ``default_config``'s value. ``eval_step`` belongs
    to an evaluation, not to the run: it starts unset."""
    saved = read_saved_config(workdir)
    path = storage.as_path(workdir, '--workdir') / CONFIG_FILE
    if saved is None:
        raise ValueError(f"{path} does not exist: give the --workdir of a train.py run "
                         "(or --config)")
    if not (isinstance(saved.get("task"), str) and isinstance(saved.get("model"), dict)
            and isinstance(saved.get("data"), dict)):
        raise ValueError(f"{path} is not a posjax run's config (keys {sorted(saved)[:8]}; a "
                         "run's has task, model, data, ...): give the --workdir of a train.py "
                         "run, or a --config file")
    return ml_collections.ConfigDict({**_with_defaults(config_dict(default_config()), saved),
                                      "eval_step": eval_step_field()})


def _with_defaults(defaults: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with every key of ``defaults`` it lacks, recursively."""
    out = dict(saved)
    for k, v in defaults.items():
        if k not in out:
            out[k] = v
        elif isinstance(v, dict) and isinstance(out[k], dict):
            out[k] = _with_defaults(v, out[k])
    return out
