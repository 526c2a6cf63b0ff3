"""The workdir: what may be written there (``check_workdir``: writable, no other run's
checkpoints, no lost checkpoints of this one), which data it was trained on
(``DATA_IDENTITY_FILE``, ``check_data_identity``), which config it saves, and the names of its
evaluation results (``eval_file``).

Layout: ``config.json`` (the run's config; once the run has a checkpoint, a run with another
config is refused; before that the file is replaced), ``checkpoints/<step>/`` (state + input
iterator: ``checkpointing``), ``checkpoints/eval_<step>_<split>.json`` (``eval_file``),
``metrics.jsonl``, ``tensorboard/``, ``loss_curve.png``, ``train.lock`` (``checkpointing.lock``:
one run per workdir), ``data_identity.json`` (digests of what the data files mean, e.g. the
vocabulary, recorded at the run's start).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import re
from typing import Any

import ml_collections

from posjax import config_defaults, storage
from posjax.data import identity as identity_lib
from posjax.io_utils import cannot_write_in, check_creatable, local_path, write_text_atomically
from posjax.training import metrics as metrics_lib
from posjax.training import run_config
from posjax.training.checkpointing import lock
from posjax.training.checkpointing import integrity

DATA_IDENTITY_FILE = identity_lib.FILE


def write_json(path: pathlib.Path, data: Any) -> None:
    """``data`` as indented JSON into ``path``, atomically (``write_text_atomically``)."""
    write_text_atomically(path, json.dumps(data, indent=2) + "\n")


def check_workdir(workdir: pathlib.Path, config: ml_collections.ConfigDict,
                  data_identity: dict[str, Any] | None = None) -> None:
    """Writable, and not holding a checkpointed run of another config (a ``config.json`` left
    by a run that stopped before its first checkpoint is replaced: nothing depends on it), nor
    of other data under the same paths (``data_identity``, ``check_data_identity``)."""
    check_writable(workdir)
    check_entries(workdir, TRAIN_ENTRIES)
    if not integrity.saved_steps(workdir):
        check_fresh_start(workdir, config)
        return
    saved = config_defaults.read_saved_config(workdir)
    if saved is None:
        raise ValueError(f"workdir {str(workdir)!r} holds checkpoints but no "
                         f"{config_defaults.CONFIG_FILE} (the "
                         "run's config): restore it from a copy to resume, or use a new "
                         "--workdir")
    saved_full = run_config.with_model_defaults(saved)
    current = run_config.with_model_defaults(config_defaults.config_dict(config))
    diffs = run_config.config_differences(saved_full, current, run_config.RESUME_KEYS)
    if diffs:
        free = resume_changes(saved, config)
        raise ValueError(
            f"workdir {str(workdir)!r} holds a run with another config; refusing to "
            "overwrite it. Differences:\n  " + "\n  ".join(diffs[:20])
            + ("\n(besides these, which may change on resume: " + "; ".join(free) + ")"
               if free else "")
            + "\nUse a new --workdir (or delete this one to start over).")
    check_data_identity(workdir, config, data_identity or {})


def resume_changes(saved: dict[str, Any], config: ml_collections.ConfigDict) -> list[str]:
    """'key: saved -> current' for the keys a resume may change (``run_config.RESUME_KEYS``)
    that do change; ``distributed`` (per process), ``init_from`` (kept) and ``eval_step``
    (eval.py's; absent from a config.json saved before it existed) left out."""
    changes = run_config.config_differences(saved, config_defaults.config_dict(config), ())
    return [c for c in changes if run_config.under(c.split(":")[0], run_config.RESUME_KEYS)
            and not run_config.under(c.split(":")[0], ("distributed", "init_from",
                                                       "eval_step"))]


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
        ranges = id_ranges(identity_lib.changed_blocks(recorded, entry))
        raise ValueError(
            f"{key}={run_config.flattened(config).get(key)!r} holds other content than this run "
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
    source = storage.as_path(config.init_from, "init_from")
    different = identity_lib.difference(identity_lib.read(source), data_identity)
    if different is None:
        return
    key, entry, recorded = different
    # A converter folder: None.
    theirs = run_config.flatten(config_defaults.read_saved_config(source) or {}).get(key)
    origin = (f"the run init_from={str(config.init_from)!r} was trained with ({key}={theirs!r} "
              "there" if theirs is not None else
              f"the weights init_from={str(config.init_from)!r} came with (the tokenizer files "
              "of the folder they were converted from")
    here = f"{key}={run_config.flattened(config).get(key)!r}"
    share = identity_lib.changed_share(recorded, entry)
    if share > EDITED_VOCABULARY_SHARE:
        raise ValueError(
            f"{here} is another vocabulary than {origin}; {share:.0%} of the ids stand for other "
            "tokens): the embedding rows would be read as other tokens; give that vocabulary")
    logging.warning("%s differs from %s) in ids %s: those embedding rows start from "
                    "another token's", here, origin,
                    id_ranges(identity_lib.changed_blocks(recorded, entry)))


def id_ranges(ranges: list[tuple[int, int]], shown: int = 5) -> str:
    """'0–1023, 4096–5119' (end inclusive), the first ``shown`` ranges, then '…'."""
    text = ", ".join(f"{start}–{end - 1}" for start, end in ranges[:shown])
    return text + (", …" if len(ranges) > shown else "")


def write_data_identity(workdir: pathlib.Path, data_identity: dict[str, Any]) -> None:
    """Record ``data_identity`` at a run's start (and for a run from before the file existed);
    a resumed run keeps what its start recorded."""
    if data_identity and (not integrity.saved_steps(workdir)
                          or not (workdir / DATA_IDENTITY_FILE).exists()):
        identity_lib.write(workdir, data_identity)


def check_writable(workdir: pathlib.Path) -> None:
    """A directory (or a path to create one at) that this process can write in (on a bucket:
    its first write says whether it can)."""
    if not storage.is_bucket(workdir):
        check_creatable(workdir, "workdir")


# What a run writes in its workdir, and an evaluation: directories ("dir"), files it writes
# into ("written") and files it replaces whole ("replaced": only the workdir must be writable).
TRAIN_ENTRIES = {"checkpoints": "dir", "tensorboard": "dir", "metrics.jsonl": "written",
                 lock.LOCK_FILE: "written", config_defaults.CONFIG_FILE: "replaced",
                 DATA_IDENTITY_FILE: "replaced", "loss_curve.png": "replaced"}


EVAL_ENTRIES = {"checkpoints": "dir", "predictions": "dir"}


def check_entries(workdir: pathlib.Path, entries: dict[str, str]) -> None:
    """Each of ``entries`` that exists in ``workdir`` is of its kind and, if written into,
    writable, so that a run does not fail after its steps (or an evaluation after evaluating)
    when it writes there (on a bucket: the kind only)."""
    for name, kind in entries.items():
        path = workdir / name
        if storage.is_bucket(path):
            if kind != "dir" and path.is_dir():
                raise ValueError(f"workdir {str(workdir)!r}: {name} is a folder, not a file: "
                                 "move it out of the workdir")
            continue
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
        saved = config_defaults.read_saved_config(workdir)
    except ValueError:   # damaged (a run cut short while writing it): replaced
        saved = None
    ours = set(config_defaults.config_dict(config))
    if saved is not None and not ("task" in saved and set(saved) <= ours):
        raise ValueError(f"workdir {str(workdir)!r}: its {config_defaults.CONFIG_FILE} is not a "
                         "posjax run's "
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
    saved = config_defaults.read_saved_config(workdir)
    if saved is None:
        return None
    diffs = run_config.config_differences(run_config.with_model_defaults(saved),
                               run_config.with_model_defaults(config_defaults.config_dict(config)),
                               run_config.EVAL_KEYS)
    if diffs:
        raise ValueError(
            f"the config differs from the run's {workdir / config_defaults.CONFIG_FILE} in keys "
            "that define the "
            "model or its checkpointed state:\n  " + "\n  ".join(diffs[:20])
            + "\nEvaluate with the run's own config (eval.py reads it when --config is not "
            "given); overrides may change only " + ", ".join(run_config.EVAL_KEYS))
    return saved


def config_to_save(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config.json of a (re)started run: ``config``, except that a resumed run keeps the
    saved ``init_from`` (where its weights came from; a resume does not read it)."""
    data = config_defaults.config_dict(config)
    if integrity.saved_steps(workdir):
        data["init_from"] = config_defaults.read_saved_config(workdir).get("init_from", "")
    return data


def evaluates_init_from(config: ml_collections.ConfigDict, workdir: pathlib.Path,
                        training: bool) -> bool:
    """eval.py on ``config.init_from``'s weights as they are (reported as step 0): set, and
    ``workdir`` is not a run's (no checkpoint, no ``config.json``: a run is evaluated on its
    own checkpoints)."""
    config_file = workdir / config_defaults.CONFIG_FILE
    return (not training and bool(config.init_from) and not integrity.saved_steps(workdir)
            and not (config_file.exists() if storage.is_bucket(workdir)
                     else os.path.lexists(config_file)))


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
