"""Training and evaluation entry points: ``train(config, workdir)``, ``evaluate(config, workdir)``.

Everything the user can get wrong (config values, mesh vs devices, batch divisibility, data
files and splits, the workdir, init_from) is checked by ``prepare``, and data that does not fit
the model by making the input pipeline, before anything is compiled or written.

Workdir layout: ``config.json`` (the run's config; once the run has a checkpoint, a run with
another config is refused; before that the file is replaced),
``checkpoints/<step>/`` (state + input iterator), ``checkpoints/eval_<step>_<split>.json``
(eval metrics of that checkpoint on ``data.test_split``, see ``eval_file``), ``metrics.jsonl``,
``tensorboard/``, ``loss_curve.png``, ``train.lock`` (who holds the workdir while a run
trains there: a second run on the same workdir is refused, see ``workdir_lock``),
``data_identity.json`` (digests of what the data files mean, e.g. the vocabulary, recorded at the
run's start: ``check_data_identity``).

Several processes: the global batch is split in row blocks, one per process, in the order the
mesh's batch sharding gives them (``process_row_blocks``); each process's input pipeline yields
its block of every process-count-independent global batch. SIGTERM (preemption) reaches
``checkpoint.Checkpointer.reached_preemption``: every process stops after the same step, saves
it and returns ``preempted=True``. Before anything is compiled or written, the processes check
that they were given the same config and data and share the workdir (``processes``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Iterator, TypeVar

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from posjax.data import identity as identity_lib
from posjax.data.common import (cannot_write_in, check_creatable, local_path,
                                signals_to_receiver_thread, write_text_atomically)
from posjax.training import checkpoint as ckpt_lib
from posjax.training import mesh as mesh_lib
from posjax.training import metrics as metrics_lib
from posjax.training import optim
from posjax.training import processes
from posjax.training import profiler
from posjax.training import state as state_lib
from posjax.training import steps as steps_lib
from posjax.training import workdir_lock
from posjax.training.tasks import Task, make_task

CONFIG_FILE = "config.json"
DATA_IDENTITY_FILE = identity_lib.FILE
EXIT_GRACE_S = 3.0   # run_command: how long a failing process > 0 lets process 0 print
EMPTY_WORKDIR = "error: --workdir is empty (an unset shell variable?): give the run's directory"
T = TypeVar("T")
# Keys that may change between a run and its resumption: they change neither the math nor the
# saved state. eval_batch_size only says how the test split is batched (padding rows are
# dropped); init_from only seeds a run that starts without a checkpoint; model.remat and
# model.gather only say how the same model is computed (recomputed activations, DeBERTa's
# relative-position strategy). data.worker_count is not one: Grain saves another input-iterator
# state with worker processes than without; nor is model.scan_layers (another parameter layout).
OPERATIONAL_KEYS = ("mesh", "checkpoint", "log_every_steps", "eval_every_steps", "peak_flops",
                    "eval_batch_size", "distributed", "init_from", "model.remat", "model.gather",
                    "profile")
# Keys eval.py may set differently from the run's config.json besides OPERATIONAL_KEYS: how and
# from where evaluation reads its data. Every other key defines the model or its saved state.
EVAL_KEYS = OPERATIONAL_KEYS + ("batch_size", "microbatches", "data.path",
                                "data.data_dir", "data.glue_dir", "data.text_files",
                                "data.tokenizer", "data.train_split", "data.test_split",
                                "data.worker_count")
# The EVAL_KEYS that say which data is read. An evaluation on other data than the run's
# (config.json) writes its results under their own names (``eval_tag``), never over the run's.
DATA_SOURCE_KEYS = ("data.path", "data.data_dir", "data.glue_dir", "data.text_files",
                    "data.tokenizer")


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
                        "process_id": -1},
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


def maybe_initialize_distributed(config: ml_collections.ConfigDict) -> None:
    """jax.distributed.initialize when ``config.distributed.enabled`` (before any device use).
    Empty address / 0 processes / -1 id: auto-detected (TPU pods, SLURM, ...)."""
    d = config.distributed
    if not d.enabled:
        return
    kwargs = {}
    if d.coordinator_address:
        kwargs["coordinator_address"] = d.coordinator_address
    if d.num_processes > 0:
        kwargs["num_processes"] = int(d.num_processes)
    if d.process_id >= 0:
        kwargs["process_id"] = int(d.process_id)
    jax.distributed.initialize(**kwargs)


def _exit_finished(signum: int, frame: Any) -> None:
    """SIGTERM after a command's work is done and written: end now, with status 0."""
    raise SystemExit(0)


def run_command(action: Callable[[], T]) -> T:
    """``action()`` for train.py / eval.py: a ValueError (bad input), ``Diverged`` or
    ``checkpoint.SaveFailed`` ends the program with 'error: …' and status 1, an abort by
    Ctrl-C with one line and status 130.
    With several processes every failure ends this process at once (``os._exit`` after
    printing): a normal exit would wait at JAX's shutdown barrier for the other processes,
    which sit in a collective waiting for this one (minutes, then an abort). Ending at once
    makes their collectives fail, so they end too. Processes other than 0 first give process 0
    ``EXIT_GRACE_S`` to print its own error: it hosts JAX's coordination service, which aborts
    it as soon as another process is gone, and a failure they share (a full disk) was printed
    by process 1 only. When process 0 ends first, the service aborts the others during their
    grace, after their error line (a fatal log and a stack dump follow it: not a second
    failure).

    Once ``action`` has returned, everything is written: a SIGTERM from then on (a scheduler
    ending the finished job while the interpreter shuts down) ends the process with status 0
    (single process), so that the run does not look preempted."""
    try:
        result = action()
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _exit_finished)
        return result
    except BaseException as e:   # noqa: B036 (SystemExit and KeyboardInterrupt included)
        several = jax.process_count() > 1
        if isinstance(e, KeyboardInterrupt) and not several:   # a second Ctrl-C (StopRequest)
            print("aborted by Ctrl-C", file=sys.stderr)
            sys.exit(130)
        if isinstance(e, (ValueError, Diverged, ckpt_lib.SaveFailed)):
            message = f"error: {e}"
        elif not several:
            raise
        else:
            message = "".join(traceback.format_exception(e))
        if not several:
            sys.exit(message)
        print(f"process {jax.process_index()}: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if jax.process_index() != 0:
            time.sleep(EXIT_GRACE_S)
        os._exit(1)


# ----------------------------------------------------------------------------- validation


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_known_keys(config: ml_collections.ConfigDict) -> None:
    """Every key (top level, optimizer, checkpoint, profile, distributed) must be one
    default_config defines: a misspelt key in a config file would otherwise be ignored
    silently."""
    defaults = default_config()
    problems = [f"{k!r}" for k in sorted(set(config) - set(defaults))]
    for group in ("optimizer", "checkpoint", "profile", "distributed"):
        if group in config:
            extra = sorted(set(config[group]) - set(defaults[group]))
            problems += [f"'{group}.{k}'" for k in extra]
    if problems:
        raise ValueError(f"unknown config key(s) {', '.join(problems)}: the training config has "
                         "no such field (see posjax.training.loop.default_config)")


def validate_training_config(config: ml_collections.ConfigDict) -> None:
    """Scalar training keys (the task, optimizer and data check their own)."""
    check_known_keys(config)
    for key in ("num_steps", "batch_size", "microbatches", "log_every_steps"):
        v = config[key]
        _check(isinstance(v, int) and v > 0, f"{key}={v!r} is not valid: must be a positive "
                                             "integer")
    for key in ("eval_batch_size", "eval_every_steps"):
        v = config[key]
        _check(isinstance(v, int) and v >= 0, f"{key}={v!r} is not valid: must be an integer "
                                              ">= 0 (0 = default)")
    _check(config.checkpoint.every_steps > 0, f"checkpoint.every_steps="
           f"{config.checkpoint.every_steps!r} is not valid: must be > 0")
    _check(config.checkpoint.keep >= 0, f"checkpoint.keep={config.checkpoint.keep!r} is not "
           "valid: must be >= 0 (0 keeps all)")
    _check(0 <= config.peak_flops < math.inf, f"peak_flops={config.peak_flops!r} is not valid: "
           "must be a finite number >= 0 (0 = default)")
    optim.validate(config.optimizer, config.num_steps)
    profiler.validate(config.profile, config.num_steps)


def validate_batch(config: ml_collections.ConfigDict, mesh: Mesh) -> None:
    """The global batch must split evenly over processes, batch shards and microbatches."""
    shards = mesh_lib.batch_shards(mesh)
    n = config.microbatches
    for key in ("batch_size", "eval_batch_size"):
        size = config[key] or config.batch_size
        need = shards * (n if key == "batch_size" else 1)
        _check(size % need == 0,
               f"{key}={size} is not divisible by " + (
                   f"microbatches={n} x batch shards (data x fsdp = {shards})"
                   if key == "batch_size" else f"the batch shards (data x fsdp = {shards})")
               + f": use a multiple of {need}")
        _check(size % jax.process_count() == 0,
               f"{key}={size} is not divisible by the {jax.process_count()} processes")
    process_row_blocks(mesh)   # raises when processes do not own one block of rows each


def process_row_blocks(mesh: Mesh) -> dict[int, int]:
    """{process index: k}: the process owns rows block k of the global batch (blocks of
    b / processes rows in row order), so it feeds shard k of the input pipeline and
    ``make_array_from_process_local_data`` places its rows where the pipeline means them."""
    shards = mesh_lib.batch_shards(mesh)
    rows: dict[int, set[int]] = {}
    sharding = mesh_lib.batch_sharding(mesh)
    for device, index in sharding.devices_indices_map((shards,)).items():
        rows.setdefault(device.process_index, set()).update(range(shards)[index[0]])
    return row_blocks(rows, shards, f"mesh {dict(mesh.shape)}")


def row_blocks(rows: dict[int, set[int]], shards: int, where: str) -> dict[int, int]:
    """{process: k} from the batch shards each process holds ({process: shard indices} of
    ``shards``): process p must hold exactly the contiguous shards of block k, blocks of
    shards / processes, one block per process. ``where`` names the mesh in the error."""
    _check(shards % len(rows) == 0,
           f"{where} has data x fsdp = {shards} batch shards, which do not split over the "
           f"{len(rows)} processes: make data x fsdp a multiple of {len(rows)}")
    size = shards // len(rows)
    blocks = {p: min(r) // size for p, r in rows.items()}
    contiguous = all(r == set(range(blocks[p] * size, (blocks[p] + 1) * size))
                     for p, r in rows.items())
    _check(contiguous and sorted(blocks.values()) == list(range(len(rows))),
           f"{where} does not give each of the {len(rows)} processes its own contiguous block "
           f"of batch rows (batch shards by process: "
           f"{ {p: sorted(r) for p, r in sorted(rows.items())} }): make data x fsdp a multiple "
           "of the process count, with each process's devices adjacent along data x fsdp")
    return blocks


def config_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config as plain JSON-compatible data (tuples become lists)."""
    return json.loads(config.to_json())


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def config_differences(saved: dict[str, Any], current: dict[str, Any],
                       free: tuple[str, ...] = OPERATIONAL_KEYS) -> list[str]:
    """'key: saved -> current' for every key that differs, ignoring the keys in ``free`` (and
    everything under them)."""
    a, b = _flat(saved), _flat(current)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b)) if not _under(k, free) and a.get(k) != b.get(k)]


def _under(key: str, sections: tuple[str, ...]) -> bool:
    """Whether the flat ``key`` is one of ``sections`` or lies under one (``data.text_files``
    holds ``data.text_files.valid``)."""
    return any(key == s or key.startswith(s + ".") for s in sections)


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


def read_saved_config(workdir: str | pathlib.Path) -> dict[str, Any] | None:
    """The run's ``config.json`` as a dict; None when the workdir has none."""
    path = local_path(workdir, "--workdir") / CONFIG_FILE
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:   # OSError: a directory
        saved = e
    if not isinstance(saved, dict):
        why = saved if isinstance(saved, Exception) else "not a JSON object"
        raise ValueError(f"{path} is damaged ({why}): it should hold the run's config as JSON; "
                         "restore it from a copy, or use a new --workdir")
    return saved


def load_saved_config(workdir: str | pathlib.Path) -> ml_collections.ConfigDict:
    """The config a train.py run saved in ``workdir`` (its ``config.json``); a key it lacks
    (saved before the key existed) takes ``default_config``'s value."""
    saved = read_saved_config(workdir)
    path = local_path(workdir, '--workdir') / CONFIG_FILE
    if saved is None:
        raise ValueError(f"{path} does not exist: give the --workdir of a train.py run "
                         "(or --config)")
    if not (isinstance(saved.get("task"), str) and isinstance(saved.get("model"), dict)
            and isinstance(saved.get("data"), dict)):
        raise ValueError(f"{path} is not a posjax run's config (keys {sorted(saved)[:8]}; a "
                         "run's has task, model, data, ...): give the --workdir of a train.py "
                         "run, or a --config file")
    return ml_collections.ConfigDict(_with_defaults(config_dict(default_config()), saved))


def _with_defaults(defaults: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with every key of ``defaults`` it lacks, recursively."""
    out = dict(saved)
    for k, v in defaults.items():
        if k not in out:
            out[k] = v
        elif isinstance(v, dict) and isinstance(out[k], dict):
            out[k] = _with_defaults(v, out[k])
    return out


def write_json(path: pathlib.Path, data: Any) -> None:
    """``data`` as indented JSON into ``path``, atomically (``write_text_atomically``)."""
    write_text_atomically(path, json.dumps(data, indent=2) + "\n")


def saved_steps(workdir: pathlib.Path) -> list[int]:
    """Steps of the finalized checkpoints in ``workdir/checkpoints`` (none: a fresh start)."""
    import orbax.checkpoint as ocp

    return sorted(ocp.utils.checkpoint_steps(workdir / "checkpoints"))


def check_workdir(workdir: pathlib.Path, config: ml_collections.ConfigDict,
                  data_identity: dict[str, Any] | None = None) -> None:
    """Writable, and not holding a checkpointed run of another config (a ``config.json`` left
    by a run that stopped before its first checkpoint is replaced: nothing depends on it), nor
    of other data under the same paths (``data_identity``, ``check_data_identity``)."""
    check_writable(workdir)
    check_entries(workdir, TRAIN_ENTRIES)
    if not saved_steps(workdir):
        check_fresh_start(workdir, config)
        return
    saved = read_saved_config(workdir)
    if saved is None:
        raise ValueError(f"workdir {str(workdir)!r} holds checkpoints but no {CONFIG_FILE} (the "
                         "run's config): restore it from a copy to resume, or use a new "
                         "--workdir")
    diffs = config_differences(with_model_defaults(saved),
                               with_model_defaults(config_dict(config)))
    if diffs:
        raise ValueError(
            f"workdir {str(workdir)!r} holds a run with another config; refusing to "
            "overwrite it. Differences:\n  " + "\n  ".join(diffs[:20])
            + "\nUse a new --workdir (or delete this one to start over).")
    check_data_identity(workdir, config, data_identity or {})


def check_data_identity(workdir: pathlib.Path, config: ml_collections.ConfigDict,
                        data_identity: dict[str, Any], training: bool = True) -> None:
    """The task's ``data_identity()`` must equal what the run recorded at its start in
    ``DATA_IDENTITY_FILE``, key by key: a resumed or evaluated run reads the same content (its
    vocabulary: which token each embedding row stands for), even where a file was rewritten in
    place. Runs from before the file existed are not checked."""
    if not data_identity:
        return
    if (different := identity_lib.difference(identity_lib.read(workdir), data_identity)):
        key, entry, recorded = different
        ranges = _id_ranges(identity_lib.changed_blocks(recorded, entry))
        raise ValueError(
            f"{key}={_flat(config_dict(config)).get(key)!r} holds other content than this run "
            f"was trained with (ids {ranges} differ from what the run recorded in "
            f"{workdir / DATA_IDENTITY_FILE}): give the file the run used"
            + (", or start a new --workdir" if training else ""))


# init_from weights with another vocabulary: up to this share of ids changed (in blocks) it is
# an edited one (e.g. BERT's [unused] rows given new words: a warning), beyond it another one.
EDITED_VOCABULARY_SHARE = 0.5


def check_init_from_data(config: ml_collections.ConfigDict,
                         data_identity: dict[str, Any]) -> None:
    """``init_from`` weights that recorded their data identity (``DATA_IDENTITY_FILE`` of a
    train.py run, or of a converter folder from the tokenizer files the imported weights came
    with): a text encoder's embedding rows stand for the tokens of the vocabulary it was
    trained with. Another vocabulary (more than ``EDITED_VOCABULARY_SHARE`` of the ids
    changed) is refused; an edited one is named in a warning."""
    if not config.init_from or not data_identity:
        return
    source = local_path(config.init_from, "init_from")
    different = identity_lib.difference(identity_lib.read(source), data_identity)
    if different is None:
        return
    key, entry, recorded = different
    theirs = _flat(read_saved_config(source) or {}).get(key)   # a converter folder: None
    origin = (f"the run init_from={str(config.init_from)!r} was trained with ({key}={theirs!r} "
              "there" if theirs is not None else
              f"the weights init_from={str(config.init_from)!r} came with (the tokenizer files "
              "of the folder they were converted from")
    here = f"{key}={_flat(config_dict(config)).get(key)!r}"
    share = identity_lib.changed_share(recorded, entry)
    if share > EDITED_VOCABULARY_SHARE:
        raise ValueError(
            f"{here} is another vocabulary than {origin}; {share:.0%} of the ids stand for other "
            "tokens): the embedding rows would be read as other tokens; give that vocabulary")
    logging.warning("%s differs from %s) in ids %s: those embedding rows start from "
                    "another token's", here, origin,
                    _id_ranges(identity_lib.changed_blocks(recorded, entry)))


def _id_ranges(ranges: list[tuple[int, int]], shown: int = 5) -> str:
    """'0–1023, 4096–5119' (end inclusive), the first ``shown`` ranges, then '…'."""
    text = ", ".join(f"{start}–{end - 1}" for start, end in ranges[:shown])
    return text + (", …" if len(ranges) > shown else "")


def write_data_identity(workdir: pathlib.Path, data_identity: dict[str, Any]) -> None:
    """Record ``data_identity`` at a run's start (and for a run from before the file existed);
    a resumed run keeps what its start recorded."""
    if data_identity and (not saved_steps(workdir) or not (workdir / DATA_IDENTITY_FILE).exists()):
        identity_lib.write(workdir, data_identity)


def check_writable(workdir: pathlib.Path) -> None:
    """A directory (or a path to create one at) that this process can write in."""
    check_creatable(workdir, "workdir")


# What a run writes in its workdir, and an evaluation: directories ("dir"), files it writes
# into ("written") and files it replaces whole ("replaced": only the workdir must be writable).
TRAIN_ENTRIES = {"checkpoints": "dir", "tensorboard": "dir", "metrics.jsonl": "written",
                 workdir_lock.LOCK_FILE: "written", CONFIG_FILE: "replaced",
                 DATA_IDENTITY_FILE: "replaced", "loss_curve.png": "replaced"}
EVAL_ENTRIES = {"checkpoints": "dir", "predictions": "dir"}


def check_entries(workdir: pathlib.Path, entries: dict[str, str]) -> None:
    """Each of ``entries`` that exists in ``workdir`` is of its kind and, if written into,
    writable, so that a run does not fail after its steps (or an evaluation after evaluating)
    when it writes there."""
    for name, kind in entries.items():
        path = workdir / name
        if not os.path.lexists(path):
            continue
        if not path.exists():
            raise ValueError(f"workdir {str(workdir)!r}: {name} is a symbolic link to "
                             f"{os.readlink(path)!r}, which does not exist (storage not "
                             "mounted?): mount it, or remove the link")
        if path.is_dir() != (kind == "dir"):
            kinds = ("a directory", "a file") if path.is_dir() else ("a file", "a directory")
            raise ValueError(f"workdir {str(workdir)!r}: {name} is {kinds[0]}, not {kinds[1]}: "
                             "move it out of the workdir")
        why = cannot_write_in(path) if kind == "dir" else None
        if kind == "written":
            try:
                open(path, "a").close()   # writes nothing
            except OSError as e:
                why = e.strerror
        if why:
            raise ValueError(f"workdir {str(workdir)!r}: {name} is not writable ({why}): make "
                             "it writable, or use another --workdir")


def check_fresh_start(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> None:
    """A workdir without checkpoints, about to be started from step 0, holds nothing a fresh
    start would wrongly replace: no other program's ``config.json``, and no metrics of a run
    that must have saved checkpoints (they were lost, or are on storage that is not mounted:
    starting over would erase its metrics.jsonl)."""
    try:
        saved = read_saved_config(workdir)
    except ValueError:   # damaged (a run cut short while writing it): replaced
        saved = None
    ours = set(config_dict(config))
    if saved is not None and not ("task" in saved and set(saved) <= ours):
        raise ValueError(f"workdir {str(workdir)!r}: its {CONFIG_FILE} is not a posjax run's "
                         f"(keys {sorted(saved)[:8]}); refusing to replace it: use another "
                         "--workdir")
    # The first save is at every_steps; by the log after step 2 * every_steps it is on disk
    # (a save waits for the one before), so later records mean a run whose saves are gone.
    every = (saved or {}).get("checkpoint", {}).get("every_steps", config.checkpoint.every_steps)
    records = metrics_lib.read_metrics(workdir / "metrics.jsonl")
    last = max((r["step"] for r in records if isinstance(r.get("step"), int)), default=0)
    if last > 2 * every:
        raise ValueError(
            f"workdir {str(workdir)!r} has metrics up to step {last} but no checkpoint in "
            f"{workdir / 'checkpoints'} (checkpoint.every_steps={every}): if the checkpoints are "
            "elsewhere (storage not mounted?), bring them back to resume; to start over "
            "here, delete metrics.jsonl; or use a new --workdir")


def check_eval_config(workdir: pathlib.Path, config: ml_collections.ConfigDict
                      ) -> dict[str, Any] | None:
    """Evaluation may change only EVAL_KEYS against the run's ``config.json`` (the rest defines
    the model and the state its checkpoints hold). Returns that saved config (None: none)."""
    saved = read_saved_config(workdir)
    if saved is None:
        return None
    diffs = config_differences(with_model_defaults(saved),
                               with_model_defaults(config_dict(config)), EVAL_KEYS)
    if diffs:
        raise ValueError(
            f"the config differs from the run's {workdir / CONFIG_FILE} in keys that define the "
            "model or its checkpointed state:\n  " + "\n  ".join(diffs[:20])
            + "\nEvaluate with the run's own config (eval.py reads it when --config is not "
            "given); overrides may change only " + ", ".join(EVAL_KEYS))
    return saved


# ----------------------------------------------------------------------------- run setup


@dataclasses.dataclass
class Run:
    """Everything built from a validated config, before any compilation."""

    config: ml_collections.ConfigDict
    workdir: pathlib.Path
    task: Task
    model: nn.Module
    mesh: Mesh
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    abstract: state_lib.TrainState
    shardings: state_lib.TrainState
    evaluates_init_from: bool = False   # eval.py on init_from's weights (``evaluates_init_from``)
    eval_tag: str = ""                  # eval.py on other data than the run's (``eval_tag``)
    data_identity: dict[str, Any] = dataclasses.field(default_factory=dict)   # task's, at set-up

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0

    def context(self):
        """Mesh + logical rules, active while steps are traced and run."""
        return _Context(self.mesh)

    def make_pipeline(self, split: str, global_batch_size: int, train: bool) -> Any:
        """This process's input pipeline: shard k of ``jax.process_count()``, k = the block of
        batch rows the mesh gives this process (``process_row_blocks``)."""
        count = jax.process_count()
        shard = process_row_blocks(self.mesh)[jax.process_index()]
        return self.task.make_pipeline(split, global_batch_size // count, self.config.seed,
                                       train, shard, count)

    def make_eval_pipeline(self) -> Any:
        """One pass over ``data.test_split`` in eval batches."""
        return self.make_pipeline("test", self.config.eval_batch_size or self.config.batch_size,
                                  False)


class _Context:
    def __init__(self, mesh: Mesh):
        self._mesh = jax.set_mesh(mesh)
        self._rules = nn.logical_axis_rules(mesh_lib.LOGICAL_RULES)

    def __enter__(self):
        self._mesh.__enter__()
        self._rules.__enter__()

    def __exit__(self, *exc):
        self._rules.__exit__(*exc)
        self._mesh.__exit__(*exc)


def prepare(config: ml_collections.ConfigDict, workdir: str | pathlib.Path,
            training: bool) -> Run:
    """Validate everything and build the run's objects (abstract only: nothing compiled)."""
    workdir = local_path(workdir, "--workdir")
    processes.check_same_software()
    check_same_config(config)   # first: else one process may fail alone on its own config
    task = make_task(config)
    validate_training_config(config)
    task.validate()
    mesh = mesh_lib.build_mesh(config.mesh)
    validate_batch(config, mesh)
    identity = task.data_identity()
    check_same_data_identity(config, identity)
    if not training:   # (train.py checks once it holds the workdir)
        processes.check_shared_workdir(workdir, CONFIG_FILE)
    pretrained = evaluates_init_from(config, workdir, training)
    tag = ""
    if training:
        check_workdir(workdir, config, identity)
    elif pretrained:
        check_writable(workdir)
        check_entries(workdir, EVAL_ENTRIES)
    elif not (workdir / "checkpoints").is_dir():
        raise ValueError(f"workdir {str(workdir)!r} has no checkpoints/: train there first "
                         "(or give config.init_from to evaluate pretrained weights)")
    else:
        check_entries(workdir, EVAL_ENTRIES)   # the metrics JSON goes beside the checkpoint
        tag = eval_tag(check_eval_config(workdir, config), config)
        check_data_identity(workdir, config, identity, training=False)   # whatever its path
    model = task.build_model()
    tx, schedule = optim.make_optimizer(config.optimizer, config.num_steps)
    abstract, shardings = state_lib.abstract_state(task, model, tx, mesh, config.seed)
    if (training and config.init_from and not saved_steps(workdir)) or pretrained:
        state_lib.check_init_from(config.init_from, abstract.params, task.patch_grid,
                                  task.model_config, whole=pretrained)
        check_init_from_data(config, identity)
    return Run(config, workdir, task, model, mesh, tx, schedule, abstract, shardings,
               pretrained, tag, identity)


def check_same_config(config: ml_collections.ConfigDict) -> None:
    """Every process must have process 0's config (``config.distributed`` may differ):
    ``processes.check_agree``."""
    processes.check_agree(lambda: {k: v for k, v in _flat(config_dict(config)).items()
                                   if not _under(k, ("distributed",))},
                          "were started with different configs",
                          "Start every process with the same --config and --config.* flags "
                          "(only config.distributed may differ).")


def check_same_data_identity(config: ml_collections.ConfigDict,
                             data_identity: dict[str, Any]) -> None:
    """Every process's data files must mean what process 0's do (``data_identity``: the
    vocabulary), though the configs agree: a host with another copy under the same path."""
    def show(key: str, entry: Any, first: Any) -> str:
        ranges = _id_ranges(identity_lib.changed_blocks(first or {}, entry or {}))
        return f"{key}={_flat(config_dict(config)).get(key)!r} holds another vocabulary than " \
               f"process 0's (ids {ranges} differ)"

    processes.check_agree(lambda: data_identity, "read different data",
                          "Give every host the same copy of the data files.", show)


def check_same_splits(pipelines: dict[str, Any]) -> None:
    """Every process's copy of each split must hold as many examples as process 0's (else its
    share of the global batches shifts, and an evaluation pass of another length waits forever
    in a collective). ``pipelines``: {"train" or "test": its pipeline (``num_examples``)}."""
    processes.check_agree(
        lambda: {split: getattr(pipe, "num_examples", None) for split, pipe in pipelines.items()},
        "read different data",
        "Give every host the same copy of the data (the files or TFDS data_dir of config.data).",
        lambda split, n, first: f"its data.{split}_split has {n} examples (process 0: {first})")


def check_same_init_from(path: str) -> None:
    """Every process must read the same weights from ``init_from`` (``path``) as process 0
    (``state.init_from_fingerprint``): a host with its own copy of another checkpoint under
    that path would load other parameters into its shards of the one model."""
    processes.check_agree(
        lambda: {"init_from": state_lib.init_from_fingerprint(path)}, "read different data",
        "Give every host the same copy of the weights (or keep them on a file system every "
        "host mounts), and start from a run's checkpoints only once it has stopped saving.",
        lambda key, mine, first: f"init_from={path!r} holds other weights than process 0's "
                                 f"({'none' if mine is None else 'another checkpoint'} there)")


def evaluates_init_from(config: ml_collections.ConfigDict, workdir: pathlib.Path,
                        training: bool) -> bool:
    """eval.py on ``config.init_from``'s weights as they are (reported as step 0): set, and
    ``workdir`` is not a run's (no checkpoint, no ``config.json``: a run is evaluated on its
    own checkpoints)."""
    return (not training and bool(config.init_from) and not saved_steps(workdir)
            and not os.path.lexists(workdir / CONFIG_FILE))


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process's rows -> global arrays sharded over data × fsdp."""
    return {k: jax.make_array_from_process_local_data(mesh_lib.batch_sharding(mesh, v.ndim),
                                                      np.asarray(v))
            for k, v in local.items()}


# ----------------------------------------------------------------------------- evaluation


def run_evaluation(run: Run, params: Any, eval_step, batches: Iterator[dict[str, np.ndarray]],
                   num_batches: int | None, predictions_dir: pathlib.Path | None = None,
                   holds_state: bool = False) -> dict[str, float]:
    """One pass over the test split's ``batches`` (this process's, ``num_batches`` of them; a
    grain iterator, closed at the end to stop its input workers); per-example outputs gathered
    from every process, padded examples dropped, then ``task.summarize`` (and
    ``task.write_predictions`` into ``predictions_dir`` when given, on process 0). Prints a
    progress line (batches done, examples/s, ETA) at most every ``EVAL_PROGRESS_S``."""
    collected: dict[str, list[np.ndarray]] = {}
    progress = EvalProgress(num_batches)
    # Closing stops the input workers, as in train.
    with memory_advice(run, evaluating=True, holds_state=holds_state), \
            contextlib.closing(batches):
        for local in batches:
            batch = global_batch(local, run.mesh)
            outputs = dict(eval_step(params, batch))
            outputs["__mask__"] = batch["mask"]
            gathered = multihost_utils.process_allgather(outputs, tiled=True)
            for k, v in gathered.items():
                collected.setdefault(k, []).append(np.asarray(v))
            if (line := progress.batch_done(int(np.sum(gathered["__mask__"])))) is not None:
                _print(run, line)
    mask = np.concatenate(collected.pop("__mask__")).astype(bool)
    outputs = {k: np.concatenate(v)[mask] for k, v in collected.items()}
    if predictions_dir is not None and run.is_main:
        with ckpt_lib.writing(f"the predictions in {predictions_dir}"):
            run.task.write_predictions(outputs, predictions_dir)
    return run.task.summarize(outputs)


@contextlib.contextmanager
def memory_advice(run: Run, evaluating: bool = False, holds_state: bool = True
                  ) -> Iterator[None]:
    """XLA's RESOURCE_EXHAUSTED inside the block (device memory; host memory on CPU), raised
    when a program is compiled or run, becomes one ValueError: what each device holds
    (``holds_state``: the train state, else the parameters), and the config keys that make
    training (or ``evaluating``) fit. XLA's whole report (its largest allocations, on GPU and
    TPU) is logged first."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        first = ckpt_lib.short_error(str(e))
        if "RESOURCE_EXHAUSTED" not in first:
            raise
        logging.error("%s", str(e).strip())
        xla = first.replace("RESOURCE_EXHAUSTED: ", "")
        raise ValueError(out_of_memory_message(run, xla, evaluating, holds_state)) from None


def out_of_memory_message(run: Run, xla: str, evaluating: bool, holds_state: bool) -> str:
    """The error for a run out of memory (``xla``: XLA's words; see ``memory_advice``)."""
    config, mesh = run.config, run.mesh
    shards = mesh_lib.batch_shards(mesh)
    limit = device_memory_limit()
    params = bytes_per_device(run.abstract.params)
    held, held_name, verb, sharded = (
        (bytes_per_device(run.abstract), "the train state (parameters and optimizer state)",
         "takes", "state") if holds_state else (params, "the parameters", "take", "parameters"))
    sharding = (f"shard the {sharded} over more devices (mesh.fsdp, now {mesh.shape['fsdp']}; "
                f"mesh.tensor, now {mesh.shape['tensor']})")
    if evaluating:
        per_device = (config.eval_batch_size or config.batch_size) // shards
        rest = f"one eval batch's activations ({_examples(per_device)} per device)"
        fixes = [f"lower eval_batch_size (now {config.eval_batch_size}; 0: batch_size, "
                 f"{config.batch_size})"] if per_device > 1 else []
        fix = _alternatives(fixes + [sharding])
    else:
        m = config.microbatches
        per_device = config.batch_size // shards // m
        rest = f"the gradients and one pass's activations ({_examples(per_device)} per device)"
        # The state, the gradients (and their sum over microbatches) whatever the batch.
        fixed = None if held is None or params is None else held + params * (1 + (m > 1))
        if limit and fixed is not None and fixed >= 0.9 * limit:
            fix = (f"with the gradients it (nearly) fills each device ({byte_size(fixed)}) "
                   f"whatever the batch: {sharding}, or train a smaller model")
        else:
            fixes = [f"lower batch_size (now {config.batch_size}) or raise microbatches (now "
                     f"{m}: each step then runs in that many passes over parts of the batch, "
                     "with the same gradients)"] if per_device > 1 else []
            if not getattr(run.task.model_config, "remat", True):
                fixes.append("set model.remat=True (recompute each layer's activations in the "
                             "backward pass)")
            fix = _alternatives(fixes + [sharding])
    if held is None:
        holds = f"Each device holds {held_name} and {rest}."
    else:
        of = f" of the device's {byte_size(limit)}" if limit else ""
        holds = f"Per device {held_name} {verb} {byte_size(held)}{of}; the rest holds {rest}."
    return (f"{'evaluation' if evaluating else 'training'} ran out of memory ({xla}). {holds} "
            f"To fit it: {fix}.")


def state_size_line(run: Run) -> str:
    """'N parameters; the train state takes X GiB per device (of the device's Y GiB)'."""
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(run.abstract.params))
    held = bytes_per_device(run.abstract)
    limit = device_memory_limit()
    line = f"{count:,} parameters"
    if held is not None:
        line += f"; the train state takes {byte_size(held)} per device"
        if limit:
            line += f" (of the device's {byte_size(limit)})"
    return line


def _examples(n: int) -> str:
    return f"{n} example{'' if n == 1 else 's'}"


def _alternatives(options: list[str]) -> str:
    """'a', 'a or b', 'a, b, or c'."""
    if len(options) <= 2:
        return " or ".join(options)
    return ", ".join(options[:-1]) + ", or " + options[-1]


def bytes_per_device(abstract: Any) -> int | None:
    """Bytes of ``abstract``'s (ShapeDtypeStructs with shardings) shards on this process's first
    device; None when a leaf's cannot be told (an extended dtype, an uneven sharding)."""
    device = jax.local_devices()[0]
    total = 0
    try:
        for leaf in jax.tree.leaves(abstract):
            size = math.prod(leaf.shape)
            if leaf.sharding is not None:
                index = leaf.sharding.devices_indices_map(leaf.shape)[device]
                size = math.prod(len(range(n)[i]) for i, n in zip(index, leaf.shape))
            total += size * np.dtype(leaf.dtype).itemsize
    except (TypeError, ValueError, KeyError):
        return None
    return total


def device_memory_limit() -> int | None:
    """Bytes the first local device's allocator may use (GPU, TPU); None where the platform
    does not say (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def byte_size(n: float) -> str:
    """``n`` bytes in words: '512 B', '3.5 KiB', '1.03 GiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


EVAL_PROGRESS_S = 10.0   # run_evaluation's progress lines: at most one per this many seconds


class EvalProgress:
    """Progress of one evaluation pass: a line when ``EVAL_PROGRESS_S`` have passed since the
    last one; rates count from the end of the first batch (its compile excluded)."""

    def __init__(self, num_batches: int | None) -> None:
        self.num_batches, self.done, self.examples = num_batches, 0, 0
        self.start: float | None = None
        self.last = self.start_examples = 0

    def batch_done(self, real_examples: int) -> str | None:
        self.done += 1
        self.examples += real_examples
        now = time.perf_counter()
        if self.start is None:
            self.start, self.last, self.start_examples = now, now, self.examples
            return None
        if now - self.last < EVAL_PROGRESS_S:
            return None
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        per_s = (self.done - 1) / elapsed
        eta = ("?" if self.num_batches is None else
               datetime.timedelta(seconds=round((self.num_batches - self.done) / per_s)))
        return (f"eval batch {self.done}/{self.num_batches or '?'}  examples_per_s "
                f"{(self.examples - self.start_examples) / elapsed:.4g}  ETA {eta}")


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
    return {k: v for k, v in _flat(config).items() if _under(k, DATA_SOURCE_KEYS)}


def eval_tag(saved: dict[str, Any] | None, config: ml_collections.ConfigDict) -> str:
    """'' when ``config`` reads the data of the run's saved config (or there is none), else
    ``_data-<8 hex digits>`` of the data source it reads: eval.py with another data.path,
    data_dir, glue_dir, text_files or tokenizer writes its results beside the run's, not over
    them (so does a source key the saved config lacks)."""
    current = data_source(config_dict(config))
    if saved is None or data_source(saved) == current:
        return ""
    digest = hashlib.sha256(json.dumps(current, sort_keys=True).encode()).hexdigest()
    return f"_data-{digest[:8]}"


def evaluated_split(config: ml_collections.ConfigDict) -> str:
    """The split evaluation reads: ``config.data.test_split``."""
    return str(config.data.get("test_split", "test"))


def write_eval(run: Run, step: int, result: dict[str, float]) -> pathlib.Path:
    split = evaluated_split(run.config)
    path = eval_file(run.workdir, step, split, run.eval_tag)
    source = {"data": data_source(config_dict(run.config))} if run.eval_tag else {}
    if run.is_main:
        with ckpt_lib.writing(f"the eval result {path}"):
            write_json(path, {"step": step, "split": split, **source, **result})
    return path


def read_eval(run: Run, step: int) -> dict[str, float] | None:
    """The metrics ``write_eval`` saved for ``step`` (None when there is no readable file)."""
    path = eval_file(run.workdir, step, evaluated_split(run.config), run.eval_tag)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {k: v for k, v in saved.items() if k not in ("step", "split", "data")}


@signals_to_receiver_thread()   # input workers never die of a group SIGTERM
def evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path,
             step: int | None = None) -> dict[str, float]:
    """Evaluate the checkpoint at ``step`` (latest by default) and write its metrics JSON.
    In a workdir that is not a run's (``evaluates_init_from``), ``config.init_from``'s
    weights are evaluated as they are, as step 0 (a published model on a recipe's data, e.g.
    to check it before fine-tuning)."""
    run = prepare(config, workdir, training=False)
    if run.evaluates_init_from:
        if step not in (None, 0):
            raise ValueError(f"step={step}: {run.workdir / 'checkpoints'} holds no saved step; "
                             "without --step eval.py evaluates config.init_from's weights "
                             "(as step 0)")
        return _evaluate_init_from(run)
    steps = saved_steps(run.workdir)
    latest = step is None
    if step is None and steps:
        step = steps[-1]
    step, steps = _process_0_choice(run, step, steps)
    if not steps:
        raise ValueError(f"{run.workdir / 'checkpoints'} holds no saved step yet: train there "
                         "first (a run stopped before its first save leaves it empty)")
    if step not in steps:
        raise ValueError(f"step={step!r}: no such checkpoint in {run.workdir / 'checkpoints'} "
                         f"(available: {steps})")
    pipe = run.make_eval_pipeline()     # data errors before the restore
    check_same_splits({"test": pipe})
    state, step = _restore_for_eval(run, step, latest)
    params = state.params
    del state   # the optimizer state's buffers are freed: the devices hold only the params
    return _evaluate_and_write(run, params, step, pipe)


def _evaluate_init_from(run: Run) -> dict[str, float]:
    """``evaluate`` on the weights of ``config.init_from`` (``prepare`` checked that they fill
    the whole model), written as step 0."""
    pipe = run.make_eval_pipeline()     # data errors before the first compile
    check_same_splits({"test": pipe})
    check_same_init_from(run.config.init_from)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings,
                                 run.config.seed)
    state = state_lib.load_init_from(state, run.config.init_from, run.shardings,
                                     run.task.patch_grid)
    if run.is_main:
        (run.workdir / "checkpoints").mkdir(parents=True, exist_ok=True)
    params = state.params
    del state   # as in evaluate
    return _evaluate_and_write(run, params, 0, pipe)


def _evaluate_and_write(run: Run, params: Any, step: int, pipe: Any) -> dict[str, float]:
    """One pass of ``pipe`` through the eval step with ``params``, written as ``step``'s
    metrics JSON (and predictions, where the task has them)."""
    eval_step = steps_lib.make_eval_step(run.task, run.model)
    with run.context():
        result = run_evaluation(run, params, eval_step, pipe.iterator,
                                getattr(pipe, "num_batches", None),
                                run.workdir / "predictions" / f"step_{step}{run.eval_tag}")
    path = write_eval(run, step, result)
    logging.info("eval step %d: %s (written to %s)", step, result, path)
    return {"step": step, "split": evaluated_split(run.config), **result}


def _process_0_choice(run: Run, step: int | None, steps: list[int]
                      ) -> tuple[int | None, list[int]]:
    """(step, steps) as every process must see them. With several processes, a run saving in
    the workdir can show them different listings (a new latest step, a step rotated out), and
    processes that restored different steps would make one global state of them. Process 0
    decides: its step, added to the others' listing when they miss it (the restore then reads
    it); or, when its check failed, ``step`` removed from theirs, so that every process
    raises."""
    if jax.process_count() == 1:
        return step, steps
    mine = step if step in steps else -1
    chosen = int(multihost_utils.broadcast_one_to_all(np.int32(mine)))
    if chosen < 0:   # process 0 found no step (latest) or not this one
        return step, [] if step is None else [s for s in steps if s != step]
    if chosen != mine:
        logging.warning("process %d: evaluating step %d, process 0's choice (this process "
                        "listed %s in %s)", jax.process_index(), chosen, steps or "none",
                        run.workdir / "checkpoints")
    return chosen, sorted({*steps, chosen})


def _restore_for_eval(run: Run, step: int, latest: bool) -> tuple[state_lib.TrainState, int]:
    """The state at ``step``. A run training in the workdir may rotate that step out
    (checkpoint.keep) while eval.py starts: then the new ``latest`` step is read, or, for a
    step asked for by number, one error says what happened."""
    keep = run.config.checkpoint.keep
    checkpointer = ckpt_lib.Checkpointer(run.workdir, run.config.checkpoint.every_steps, keep,
                                         create=False)
    try:
        for _ in range(3):
            try:
                return checkpointer.restore(step, run.abstract), step
            except ValueError:
                steps = saved_steps(run.workdir)
                removed = (not (checkpointer.directory / str(step)).exists()
                           or 0 < keep <= sum(s > step for s in steps))   # being removed
                if not removed or jax.process_count() > 1:   # processes would differ
                    raise
                steps = [s for s in steps if s != step]
            if not (latest and steps):
                raise ValueError(
                    f"step={step}: {checkpointer.directory / str(step)} was removed while it was "
                    "read (a run training there keeps only the latest checkpoint.keep steps); "
                    f"evaluate one of {steps} with --step, or the latest without it")
            step = steps[-1]
            checkpointer.manager.reload()
        raise ValueError(f"{checkpointer.directory}: the latest step kept changing while it "
                         "was read; try again")
    finally:
        checkpointer.close()


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass
class TrainResult:
    step: int                      # last step reached
    preempted: bool                # stopped by SIGTERM (or stop_after), after saving
    eval: dict[str, float]         # final eval metrics (empty when preempted)
    start: int                     # the step this run started from (= step: stopped in set-up)

    def stop_line(self) -> str | None:
        """What train.py prints when the run stopped before num_steps (None if it did not)."""
        if not self.preempted:
            return None
        if self.step != self.start:
            return f"preempted: checkpoint saved at step {self.step}; rerun to resume"
        rerun = f"rerun to resume from step {self.step}" if self.step else "rerun to start"
        return f"stopped before the first step of this run: nothing new to save; {rerun}"


@signals_to_receiver_thread()   # input workers never die of a group SIGTERM
def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path,
          stop_after: int | None = None) -> TrainResult:
    """Train to ``config.num_steps`` (resuming from the latest checkpoint in ``workdir``).

    ``stop_after``: stop (with a saved checkpoint) once this step is reached, as a preemption
    would; used to test resumption.
    """
    with ckpt_lib.StopRequest() as stop:   # from the start: a SIGTERM during set-up is no crash
        run = prepare(config, workdir, training=True)
        # Data errors (and data that does not fit the model) before anything is written, in
        # the test split too (else they would end the run at its first evaluation). The test
        # split is read once: each evaluation is a fresh pass over its dataset.
        test = run.make_eval_pipeline()
        test.iterator.close()
        pipe = run.make_pipeline("train", config.batch_size, True)
        check_same_splits({"train": pipe, "test": test})
        # Closing stops the input workers and frees the batches they had prefetched.
        with contextlib.closing(pipe.iterator):
            if stop.requested:   # before anything is written
                return _stopped_in_set_up(run)
            run.workdir.mkdir(parents=True, exist_ok=True)
            with workdir_lock.exclusive(run.workdir, run.is_main):   # one run per workdir
                processes.check_shared_workdir(run.workdir)
                if run.is_main:
                    # Again: another run may have ended.
                    check_workdir(run.workdir, config, run.data_identity)
                    write_json(run.workdir / CONFIG_FILE, config_to_save(run.workdir, config))
                    write_data_identity(run.workdir, run.data_identity)
                checkpointer = ckpt_lib.Checkpointer(
                    run.workdir, config.checkpoint.every_steps, config.checkpoint.keep,
                    config.checkpoint.async_save, stop=stop)
                try:
                    with memory_advice(run):
                        return _train(run, checkpointer, pipe.iterator, test.dataset,
                                      getattr(test, "num_batches", None), stop_after)
                finally:
                    checkpointer.close()


def _stopped_in_set_up(run: Run) -> TrainResult:
    """A stop requested before the first step of this run: nothing new to save."""
    steps = saved_steps(run.workdir)
    last = steps[-1] if steps else 0
    return TrainResult(last, True, {}, last)


def config_to_save(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config.json of a (re)started run: ``config``, except that a resumed run keeps the
    saved ``init_from`` (where its weights came from; a resume does not read it)."""
    data = config_dict(config)
    if saved_steps(workdir):
        data["init_from"] = read_saved_config(workdir).get("init_from", "")
    return data


def _start_state(run: Run, checkpointer: ckpt_lib.Checkpointer, iterator: Any
                 ) -> tuple[state_lib.TrainState, int]:
    latest = checkpointer.latest_step()
    if latest is not None:
        _print(run, f"resuming from {checkpointer.directory / str(latest)}")
        return checkpointer.restore(latest, run.abstract, iterator), latest
    if run.config.init_from:
        check_same_init_from(run.config.init_from)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings,
                                 run.config.seed)
    if run.config.init_from:
        state = state_lib.load_init_from(state, run.config.init_from, run.shardings,
                                         run.task.patch_grid)
        _print(run, f"parameters initialised from {run.config.init_from}")
    return state, 0


def _train(run: Run, checkpointer: ckpt_lib.Checkpointer, iterator: Any,
           test: Iterable[dict[str, np.ndarray]], test_batches: int | None,
           stop_after: int | None) -> TrainResult:
    config, task = run.config, run.task
    num_steps = config.num_steps
    state, start = _start_state(run, checkpointer, iterator)
    if checkpointer.stop and checkpointer.stop.begin_steps():   # nothing new to save
        return _stopped_in_set_up(run)
    train_step = steps_lib.make_train_step(task, run.model, run.tx, run.mesh, run.shardings,
                                           task.dummy_batch(1), config.microbatches)
    eval_step = steps_lib.make_eval_step(task, run.model)
    writer = metrics_lib.MetricWriter(run.workdir, run.is_main, start)
    progress = metrics_lib.Progress(num_steps, start)
    accumulator = metrics_lib.MetricAccumulator()
    step_flops = task.train_flops().total(config.batch_size)
    peak = metrics_lib.peak_flops_per_device(config.peak_flops)
    _print(run, f"{step_flops:.4g} train FLOPs/step; MFU against {peak.value:.4g} FLOP/s per "
                f"device ({peak.source}) x {jax.device_count()} devices")
    _print(run, state_size_line(run))
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)   # init used the plain seed
    preempted = False
    step = start
    first = True
    started = time.perf_counter()

    def save(force: bool = False) -> None:
        """Save ``state`` at ``step`` when due (or ``force``), never a diverged one."""
        if force or checkpointer.due(step):
            _stop_if_diverged(step, accumulator, state, checkpointer, writer)
        checkpointer.save(step, state, iterator, force=force)

    profile = profiler.StepProfile(config.profile, run.workdir, start, run.is_main)

    def end_profile() -> None:
        if (line := profile.close(state)) is not None:
            _print(run, line)
            progress.restart(step)   # writing the trace is no step time

    with run.context(), contextlib.ExitStack() as stack:
        stack.callback(end_profile)   # a run that fails within the traced steps
        while step < num_steps:
            asked = time.perf_counter()
            batch = global_batch(next(iterator), run.mesh)
            progress.input_wait += time.perf_counter() - asked
            profile.before(step + 1)
            state, step_metrics = train_step(state, batch, key)
            step += 1
            accumulator.add(step_metrics)
            checkpointer.check_background_save(step % config.log_every_steps == 0)
            if first:   # exclude compilation from throughput
                jax.block_until_ready(state.step)
                _print(run, f"step {step} (compilation included) took "
                            f"{time.perf_counter() - started:.1f}s")
                progress.restart(step)
                first = False
            if step % config.log_every_steps == 0 or step == num_steps:
                finite = accumulator.all_finite(DIVERGENCE_METRICS)
                _log_train(run, step, accumulator, progress, writer, step_flops, peak)
                if not finite:
                    _diverged(step, "the loss or gradient norm", checkpointer, writer)
            if profile.last_step(step):
                end_profile()
            save()   # before a periodic eval: a stop during the eval then loses nothing
            if config.eval_every_steps and step % config.eval_every_steps == 0 \
                    and step != num_steps:
                result = run_evaluation(run, state.params, eval_step, iter(test),
                                        test_batches, holds_state=True)
                writer.write(step, "eval", result)
                _print(run, f"eval at step {step}: {_format(result)}")
            if checkpointer.reached_preemption(step) or step == stop_after:
                end_profile()   # stopped within the traced steps: not its save
                if checkpointer.latest_step() != step:
                    save(force=True)
                checkpointer.wait()
                preempted = True
                break
        if preempted:   # train.py says so
            writer.close()
            return TrainResult(step, True, {}, start)
        if checkpointer.latest_step() != step:
            save(force=True)
        checkpointer.wait()
        result = read_eval(run, step) if start == step else None   # a finished run rerun
        if result is None:
            result = run_evaluation(run, state.params, eval_step, iter(test), test_batches,
                                    holds_state=True)
        writer.write_once(step, "eval", result)
    writer.close()
    path = write_eval(run, step, result)
    if run.is_main:
        with ckpt_lib.writing(f"the loss curve {run.workdir / 'loss_curve.png'}"):
            metrics_lib.plot_curves(run.workdir)
    _print(run, f"final eval at step {step}: {_format(result)}  ({path})")
    return TrainResult(step, False, result, start)


class Diverged(RuntimeError):
    """The training loss, gradient norm or weights became NaN or infinite."""


DIVERGENCE_METRICS = ("loss", "grad_norm")


def _stop_if_diverged(step: int, accumulator: metrics_lib.MetricAccumulator,
                      state: state_lib.TrainState, checkpointer: ckpt_lib.Checkpointer,
                      writer: metrics_lib.MetricWriter) -> None:
    """Before a save: raise ``Diverged`` unless the loss and gradient-norm sums of the steps
    since the last log and every value of ``state`` (the weights after this step's update,
    optimizer moments) are finite, so a NaN or inf is never saved and never rotates a good
    checkpoint out. The logs check the sums too (``_train``)."""
    if not accumulator.all_finite(DIVERGENCE_METRICS):
        _diverged(step, "the loss or gradient norm", checkpointer, writer)
    if not state_lib.all_finite(state):
        _diverged(step, "the updated weights or optimizer state", checkpointer, writer)


def _diverged(step: int, what: str, checkpointer: ckpt_lib.Checkpointer,
              writer: metrics_lib.MetricWriter) -> None:
    writer.close()
    checkpointer.wait()
    last = checkpointer.latest_step()
    kept = (f"the checkpoints saved before hold finite values (latest: step {last}, which may "
            "already be on the way to diverging)" if last is not None
            else "no checkpoint was saved")
    raise Diverged(f"training diverged by step {step} ({what} became NaN or infinite); it was "
                   f"stopped before saving that state: {kept}. Lower optimizer.learning_rate, "
                   "raise optimizer.warmup_steps or set optimizer.grad_clip_norm, and start "
                   "again in a new workdir (init_from can start it from a checkpoint)")


def _log_train(run: Run, step: int, accumulator: metrics_lib.MetricAccumulator,
               progress: metrics_lib.Progress, writer: metrics_lib.MetricWriter,
               step_flops: float, peak: metrics_lib.PeakFlops) -> None:
    scalars = accumulator.result()
    steps_per_s, elapsed, input_wait = progress.rate(step)
    examples_per_s = steps_per_s * run.config.batch_size
    scalars["lr"] = float(run.schedule(step - 1))
    if np.isfinite(steps_per_s):   # not on the first log after (re)compilation
        scalars.update({
            "steps_per_s": steps_per_s,
            "examples_per_s": examples_per_s,
            "mfu": peak.mfu(step_flops * steps_per_s / jax.device_count()),
            # Near 1: the input pipeline, not the devices, sets the step rate.
            "input_wait_share": min(input_wait / elapsed, 1.0),
        })
    writer.write(step, "train", scalars)
    _print(run, progress.line(step, scalars, steps_per_s))


def _format(result: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in result.items())


def _print(run: Run, line: str) -> None:
    if run.is_main:
        print(line, flush=True)


# ----------------------------------------------------------------------------- command line


def _config_args(argv: list[str]) -> str:
    out = []
    for i, a in enumerate(argv[1:], 1):
        if a.startswith("--config"):
            out.append(f"{a} {argv[i + 1]}" if a == "--config" and i + 1 < len(argv) else a)
    return " ".join(out)


def _config_error_exit(error: Exception, argv: list[str]):
    """Exit with one ``error:`` line for a config file that cannot be loaded or overridden.

    ml_collections reports an unknown override key as a KeyError (maybe inside an
    AttributeError) whose argument is the leaf name, maybe followed by a 'Did you mean ...'
    line; the whole dotted key is taken from the matching ``--config.a.b=v`` argument. Any
    other error is the config file's own."""
    import sys
    given = f"the config given by {_config_args(argv)}"
    while error.args and isinstance(error.args[0], Exception):   # AttributeError(KeyError(..))
        error = error.args[0]
    message = str(error.args[0]) if error.args else str(error)
    leaf, _, suggestion = message.partition("\n")
    leaf = leaf.strip("'\"")
    keys = [a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config.")]
    key = next((k for k in keys if leaf in k.split(".")), None)
    if isinstance(error, AttributeError) and "get_config" in message:
        sys.exit(f"error: cannot load {given}: the file defines no get_config()")
    if not isinstance(error, (KeyError, AttributeError)) or key is None:
        hint = ("; a run's config.json is loaded with --config configs/saved.py:WORKDIR"
                if any(a.endswith(".json") or ".json:" in a for a in argv) else "")
        sys.exit(f"error: cannot load {given}: {type(error).__name__}: {message}{hint}")
    fix = suggestion.strip() or "check the spelling against the config file"
    sys.exit(f"error: unknown config key {key!r} in {_config_args(argv)}: the config has no "
             f"such field ({fix})")


def _raised_message(text: str) -> str:
    """The message of the exception a formatted traceback ends with (from the first unindented
    line after the last frame, without the 'ValueError: ' prefix); ml_collections hands a failed
    get_config() over as such text."""
    lines = text.strip().splitlines()
    frames = [i for i, ln in enumerate(lines) if ln.startswith('  File "')]
    after = lines[frames[-1] + 1:] if frames else lines
    start = next((i for i, ln in enumerate(after) if not ln.startswith(" ")), 0)
    return re.sub(r"^[\w.]+: ", "", "\n".join(after[start:]).strip())


def define_config_flag(default: str | None, help_text: str) -> None:
    """``--config`` (ml_collections config file with ``--config.a.b=v`` overrides). With a
    default, ml_collections applies the overrides while the flag is defined, so an unknown key
    is reported here."""
    import sys

    from ml_collections import config_flags

    try:
        config_flags.DEFINE_config_file("config", default, help_text)
    except Exception as e:    # noqa: BLE001 -- any failure of the user's file: one line
        _config_error_exit(e, sys.argv)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flags parser for train.py / eval.py: a bad ``--config`` (missing or broken file,
    unknown key, wrong type) ends with one ``error:`` line and exit status 1, not a
    traceback."""
    import sys

    from absl import flags

    try:
        rest = flags.FLAGS(argv)
        if flags.FLAGS.config is not None:
            flags.FLAGS.config.get("task")   # a config that failed to load raises here
        return rest
    except flags.Error as e:
        if "Error whilst parsing config file" in str(e):   # get_config raised: its message
            sys.exit(f"error: cannot load the config given by {_config_args(argv)}: "
                     f"{_raised_message(str(e))}")
        sys.exit(f"error: {e}\nPass --helpfull to see the flags.")
    except OSError as e:
        detail = " ".join(str(e).split())
        sys.exit(f"error: cannot load the config given by {_config_args(argv)}: {detail}")
    except Exception as e:    # noqa: BLE001 -- unknown key, or the file itself fails to run
        _config_error_exit(e, argv)
