"""The posjax checkpoint the converter writes and ``config.init_from`` reads, and the params of
a train.py workdir (for export).

Layout of OUT_DIR:
  params/             orbax ``StandardCheckpointer`` checkpoint of ``{'params': params}``
  model_config.json   ``{"kind": "text"|"vit", "task": "mlm"|"classification"|"encoder",
                        "config": {TextConfig/ViTConfig fields}}``
  data_identity.json  (when known) the vocabularies the weights were trained with
                      (``posjax.data.identity``): init_from then refuses another one

A train.py workdir holds ``config.json`` (the run config: ``task``, ``model``) and
``checkpoints/<step>/state`` (orbax StandardCheckpointer of the train state, ``params`` inside).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from posjax.checkpoint_io import read_item
from posjax.convert.destination import write_directory
from posjax.convert.mapping import check_tree, flatten
from posjax.convert.pretrained import KINDS, TASKS, Pretrained, expected_params
from posjax.data import identity
from posjax.models.config import TextConfig, ViTConfig

MODEL_CONFIG = "model_config.json"
PARAMS = "params"


def save_checkpoint(pre: Pretrained, out_dir: str | pathlib.Path,
                    data_identity: dict[str, list[identity.Entry]] | None = None) -> pathlib.Path:
    """Write ``pre`` as OUT_DIR (see module doc), with ``data_identity`` when given (e.g.
    ``source_data_identity`` of where ``pre`` came from); all-or-nothing, never overwrites."""
    check_tree(pre.params, expected_params(pre.kind, pre.task, pre.config, pre.num_labels),
               "save_checkpoint")
    meta = {"kind": pre.kind, "task": pre.task, "config": dataclasses.asdict(pre.config)}

    def fill(staging: pathlib.Path) -> None:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(staging / PARAMS, {"params": pre.params})
        checkpointer.wait_until_finished()
        checkpointer.close()
        (staging / MODEL_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
        if data_identity:
            identity.write(staging, data_identity)

    return write_directory(out_dir, fill)


def read_model_config(folder: pathlib.Path) -> tuple[str, str, TextConfig | ViTConfig]:
    path = folder / MODEL_CONFIG
    try:
        meta = json.loads(path.read_text())
        kind, task, fields = meta["kind"], meta["task"], meta["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a posjax model config (needs kind, task, config): "
                         f"{e}") from e
    if kind not in KINDS or task not in TASKS:
        raise ValueError(f"{path}: kind={kind!r} task={task!r}: kind must be one of {KINDS}, "
                         f"task one of {TASKS}")
    config = (TextConfig if kind == "text" else ViTConfig).from_dict(fields)
    return kind, task, config


def load_checkpoint(folder: str | pathlib.Path) -> Pretrained:
    """Read a folder written by ``save_checkpoint`` back (params as np.float32)."""
    folder = pathlib.Path(folder).expanduser().resolve()
    kind, task, config = read_model_config(folder)
    try:
        restored = ocp.StandardCheckpointer().restore(folder / PARAMS)["params"]
    except Exception as e:   # orbax raises assorted errors for missing/corrupt data
        raise ValueError(f"{folder / PARAMS}: cannot restore the params checkpoint "
                         f"({type(e).__name__}: {e})") from e
    return _checked(folder, kind, task, config, restored)


def _checked(folder: pathlib.Path, kind: str, task: str, config: TextConfig | ViTConfig,
             restored) -> Pretrained:
    """Restored params as np.float32, verified against the model config."""
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), restored)
    num_labels = 0
    if kind == "text" and task == "classification":
        bias = flatten(params).get(("classifier", "bias"))
        if bias is None:
            raise ValueError(f"{folder}: task 'classification' but the params have no "
                             "classifier/bias")
        num_labels = int(np.shape(bias)[0])
    check_tree(params, expected_params(kind, task, config, num_labels), str(folder))
    return Pretrained(config, params, kind, task)


# train.py task name -> (kind, task); ViT's task follows its head.
TRAIN_TASKS = {"image_classification": ("vit", ""), "mlm": ("text", "mlm"),
               "glue": ("text", "classification")}


def is_train_workdir(folder: pathlib.Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "checkpoints").is_dir()


def load_train_workdir(folder: str | pathlib.Path) -> Pretrained:
    """The params of the latest checkpoint of a train.py workdir, with its model config."""
    folder = pathlib.Path(folder).expanduser().resolve()
    try:
        run = json.loads((folder / "config.json").read_text())
        name, fields = run["task"], run["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{folder / 'config.json'}: not a train.py run config (needs task, "
                         f"model): {e}") from e
    if name not in TRAIN_TASKS:
        raise ValueError(f"{folder / 'config.json'}: task={name!r} has no exportable model: "
                         f"known tasks are {', '.join(TRAIN_TASKS)}")
    steps = sorted(int(p.name) for p in (folder / "checkpoints").iterdir()
                   if p.name.isdigit() and (p / "state").is_dir())
    if not steps:
        raise ValueError(f"{folder / 'checkpoints'}: no checkpoints/<step>/state to read")
    state_dir = folder / "checkpoints" / str(steps[-1]) / "state"
    kind, task = TRAIN_TASKS[name]
    config = (TextConfig if kind == "text" else ViTConfig).from_dict(fields)
    if kind == "vit":
        task = "classification" if config.num_classes else "encoder"
    restored = read_item(state_dir, ocp.StandardCheckpointHandler(),
                         lambda handler: handler.restore(state_dir))["params"]
    return _checked(folder, kind, task, config, restored)
