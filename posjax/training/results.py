"""Evaluation result files: ``checkpoints/eval_<step>_<split tag><data tag>.json``, one per
evaluated split of a checkpoint (and per data source other than the run's: ``eval_tag``)."""
from __future__ import annotations

import hashlib
import json
import pathlib
import re
from typing import TYPE_CHECKING, Any

import ml_collections

from posjax import config_defaults
from posjax.training import checkpoint as ckpt_lib
from posjax.training import run_config
from posjax.training import workdir as workdir_lib

if TYPE_CHECKING:
    from posjax.training import run_setup


def split_tag(split: str) -> str:
    """A split spec as a file-name part: ``test`` -> ``test``, ``train[:80%]`` -> ``train_-80%``
    (``[`` -> ``_``, ``:`` -> ``-``, ``]`` dropped, any other character outside [A-Za-z0-9_.%-]
    -> ``_``)."""
    tag = split.replace("[", "_").replace(":", "-").replace("]", "")
    return re.sub(r"[^A-Za-z0-9_.%-]", "_", tag)


def eval_file(workdir: pathlib.Path, step: int, split: str, tag: str = "") -> pathlib.Path:
    """``checkpoints/eval_<step>_<split tag><tag>.json``: one file per evaluated split (and per
    data source other than the run's, ``eval_tag``)."""
    return workdir / "checkpoints" / f"eval_{step}_{split_tag(split)}{tag}.json"


def data_source(config: dict[str, Any]) -> dict[str, Any]:
    """The ``DATA_SOURCE_KEYS`` values of a config dict, flattened (``data.text_files.valid``)."""
    return {k: v for k, v in run_config.flatten(config).items()
            if run_config.under(k, run_config.DATA_SOURCE_KEYS)}


def eval_tag(saved: dict[str, Any] | None, config: ml_collections.ConfigDict) -> str:
    """'' when ``config`` reads the data of the run's saved config (or there is none), else
    ``_data-<8 hex digits>`` of the data source it reads: eval.py with another data.path,
    data_dir, glue_dir, text_files or tokenizer writes its results beside the run's, not over
    them (so does a source key the saved config lacks); ``_seq-<N>`` when it reads text at
    another length than the run's (``--config.data.max_seq_length=N``)."""
    if saved is None:
        return ""
    tag = ""
    current = data_source(config_defaults.config_dict(config))
    if data_source(saved) != current:
        digest = hashlib.sha256(json.dumps(current, sort_keys=True).encode()).hexdigest()
        tag = f"_data-{digest[:8]}"
    length = config.get("data", {}).get("max_seq_length")
    if length is not None and length != saved.get("data", {}).get("max_seq_length", length):
        tag += f"_seq-{length}"
    return tag


def evaluated_split(config: ml_collections.ConfigDict) -> str:
    """The split evaluation reads: ``config.data.test_split``."""
    return str(config.data.get("test_split", "test"))


def write_eval(run: run_setup.Run, step: int, result: dict[str, float]) -> pathlib.Path:
    split = evaluated_split(run.config)
    path = eval_file(run.workdir, step, split, run.eval_tag)
    source = {"data": data_source(config_defaults.config_dict(run.config))} if run.eval_tag else {}
    if run.is_main:
        with ckpt_lib.writing(f"the eval result {path}"):
            workdir_lib.write_json(path, {"step": step, "split": split, **source, **result})
    return path


def read_eval(run: run_setup.Run, step: int) -> dict[str, float] | None:
    """The metrics ``write_eval`` saved for ``step`` (None when there is no readable file)."""
    path = eval_file(run.workdir, step, evaluated_split(run.config), run.eval_tag)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {k: v for k, v in saved.items() if k not in ("step", "split", "data")}
