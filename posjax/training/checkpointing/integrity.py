"""Integrity of a saved step: a record of its files (``RECORD_FILE``: size and CRC-32 of
each), written by process 0 once Orbax has committed the step, and checked before the step is
restored (``damage``), so that a file cut short, lost or silently changed on the storage (bit
rot) is found before its bytes reach the model. A step found damaged is moved aside
(``move_aside``: renamed ``<step>.damaged-<reason>``, never deleted): Orbax's step listing
reads only names that are a step number, so neither a resume nor ``checkpoint.keep`` sees it.

On a bucket (``gs://``) the record is the same, each object read back for its CRC-32 (the
listing's CRC-32C would spare the download, but then restores would check another sum than
local ones); moving a step aside copies its objects and deletes them (``storage.move``: not
atomic) and ``partial_saves`` also names a step folder without Orbax's ``commit_success.txt``.

A step saved before the record existed, or by a run killed between the commit and the record,
has none: its files are then checked only by the restore itself.

The listings: ``saved_steps`` (the finalized steps) and ``intact_steps`` (those whose files
match their record by name and size).
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import zlib

import orbax.checkpoint as ocp

from posjax import storage
from posjax.io_utils import write_text_atomically

RECORD_FILE = "integrity.json"
_CHUNK = 1 << 22


def saved_steps(workdir: pathlib.Path) -> list[int]:
    """Steps of the finalized checkpoints in ``workdir/checkpoints`` (none: a fresh start)."""
    return sorted(ocp.utils.checkpoint_steps(workdir / "checkpoints"))


def intact_steps(workdir: pathlib.Path, but: tuple[int, ...] = ()) -> list[int]:
    """The saved steps of ``workdir`` (but those in ``but``) whose files match their integrity
    record by name and size (no file is read: checksums are compared when a step is
    restored; a step without a record counts as intact)."""
    directory = workdir / "checkpoints"
    return [s for s in saved_steps(workdir)
            if s not in but and damage(directory / str(s), checksums=False) is None]


def partial_saves(directory: pathlib.Path) -> list[pathlib.Path]:
    """The partial saves in ``directory`` (a run's checkpoints): ``*.orbax-checkpoint-tmp*``;
    on a bucket, where Orbax saves in place and ends a step with ``commit_success.txt``, also a
    step folder without it."""
    partials = sorted(directory.glob("*.orbax-checkpoint-tmp*"))
    if storage.is_bucket(directory) and directory.exists():
        partials += [p for p in directory.iterdir() if p.name.isdigit()
                     and not (p / "commit_success.txt").exists()]
    return partials


def _crc32(path: pathlib.Path) -> str:
    value = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def _size(path: pathlib.Path) -> int:
    """The size of the file (or bucket object: epath's stat has ``length``) ``path``."""
    stat = path.stat()
    return stat.st_size if hasattr(stat, "st_size") else stat.length


def describe(step_dir: pathlib.Path) -> dict[str, dict[str, object]]:
    """{relative path: {"size", "crc32"}} of every file under ``step_dir`` but the record
    (on a bucket too: each object read back, as a file is)."""
    names = [n for n in storage.files(step_dir) if pathlib.PurePath(n).name != RECORD_FILE]
    return {n: {"size": _size(step_dir / n), "crc32": _crc32(step_dir / n)} for n in names}


def write_record(step_dir: pathlib.Path) -> None:
    """Record ``step_dir``'s files (atomically: a record cut short is no record). A step that
    is gone meanwhile (rotated out by ``checkpoint.keep``) or a storage failure is logged and
    skipped: the step is still checked by its restore."""
    record = step_dir / RECORD_FILE
    temporary = step_dir / f".{RECORD_FILE}.tmp"
    try:
        text = json.dumps({"files": describe(step_dir)}, indent=1, sort_keys=True)
        if storage.is_bucket(step_dir):   # one upload: the whole record or none
            return write_text_atomically(record, text)
        with open(temporary, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, record)
    except FileNotFoundError:   # rotated out meanwhile
        return
    except OSError as e:
        logging.warning("no integrity record for %s (%s): its files are checked only when "
                        "it is restored", step_dir, e.strerror or e)
        if step_dir.exists() and not storage.is_bucket(step_dir):
            temporary.unlink(missing_ok=True)


def record_once(step_dir: pathlib.Path) -> None:
    """``write_record`` unless ``step_dir`` has a record or is gone (rotated out)."""
    if step_dir.is_dir() and not has_record(step_dir):
        write_record(step_dir)


def has_record(step_dir: pathlib.Path) -> bool:
    return (step_dir / RECORD_FILE).is_file()


def damage(step_dir: pathlib.Path, checksums: bool = True) -> tuple[str, str] | None:
    """(reason, detail) when ``step_dir`` does not match its record: reason is one of
    "missing" (a recorded file is gone), "truncated" (another size), "checksum" (same size,
    other bytes), "unreadable" (the record itself or a file cannot be read); None when it
    matches, or has no record. Without ``checksums`` only names and sizes are compared (no
    file is read: a listing of many large steps)."""
    record = step_dir / RECORD_FILE
    if not record.exists():
        return None
    try:
        files = json.loads(record.read_text())["files"]
        assert isinstance(files, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        return "unreadable", f"its {RECORD_FILE} cannot be read ({e})"
    for name, expected in sorted(files.items()):
        path = step_dir / name
        try:
            size = _size(path)
            if size != expected["size"]:
                return "truncated", f"{name} holds {size} bytes, {expected['size']} were saved"
            if checksums and _crc32(path) != expected["crc32"]:
                return "checksum", f"{name} does not hold the bytes saved (CRC-32 differs)"
        except FileNotFoundError:
            return "missing", f"{name} is missing"
        except OSError as e:
            return "unreadable", f"{name} cannot be read ({e.strerror or e})"
    return None


def move_aside(step_dir: pathlib.Path, reason: str) -> pathlib.Path:
    """Rename ``step_dir`` to ``<step>.damaged-<reason>`` (``-2``, ``-3``, ... when taken)
    and return the new path."""
    target = step_dir.with_name(f"{step_dir.name}.damaged-{reason}")
    n = 2
    while target.exists() if storage.is_bucket(target) else os.path.lexists(target):
        target = step_dir.with_name(f"{step_dir.name}.damaged-{reason}-{n}")
        n += 1
    storage.move(step_dir, target)   # a bucket: copied object by object, then deleted
    return target
