"""Write an output folder all-or-nothing: fill a hidden sibling, then rename it into place; on
a bucket (``gs://``), fill a local folder, then upload it with the file that marks the folder
whole (``model_config.json``, or an HF folder's ``config.json``) last."""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from typing import Any, Callable

from posjax import storage
from posjax.io_utils import check_creatable, local_path

# Uploaded last: a bucket folder without it is a cut-short upload (init_from refuses it).
LAST = ("model_config.json", "config.json")


def new_destination(dest: str | pathlib.Path, what: str = "destination") -> Any:
    """``dest`` as an absolute local path (or a ``gs://`` path); one ValueError (naming
    ``what``) if it is empty or another URL, if it exists already, or if it cannot be created
    (under a file, not writable; a bucket: no credentials)."""
    if storage.is_bucket(dest):
        path = storage.as_path(dest, what)
        storage.check_credentials(path, what)
        if storage.files(dest):
            raise ValueError(f"destination {dest} already holds objects: choose a new folder or "
                             "remove it first (posjax never overwrites checkpoints)")
        return path
    dest = local_path(dest, what)
    if dest.exists():
        raise ValueError(f"destination {dest} already exists: choose a new folder or remove it "
                         "first (posjax never overwrites checkpoints)")
    check_creatable(dest, what)
    return dest


def write_directory(dest: str | pathlib.Path, fill: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """Create ``dest`` with the files ``fill(staging_dir)`` writes; on any error nothing is left.

    ``dest`` must not exist yet (an existing folder is never overwritten or merged into).
    """
    dest = new_destination(dest)
    if storage.is_bucket(dest):
        with tempfile.TemporaryDirectory(prefix="posjax-convert-") as tmp:
            fill(pathlib.Path(tmp))
            _upload(pathlib.Path(tmp), dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        staging.chmod(0o777 & ~umask)   # mkdtemp makes it private; the result is an ordinary dir
        fill(staging)
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def _upload(folder: pathlib.Path, dest: Any) -> None:
    """Every file of ``folder`` to the bucket folder ``dest`` (streamed by gcsfs), ``LAST``
    files last; on any error the objects uploaded so far are deleted."""
    import gcsfs   # noqa: PLC0415 -- requirements.txt (gs:// workdirs)
    fs = gcsfs.GCSFileSystem()
    files = sorted((p for p in folder.rglob("*") if p.is_file()),
                   key=lambda p: (p.relative_to(folder).as_posix() in LAST, str(p)))
    done: list[str] = []
    try:
        for file in files:
            target = f"{os.fspath(dest).rstrip('/')}/{file.relative_to(folder).as_posix()}"
            fs.put_file(str(file), target)
            done.append(target)
    except BaseException:
        for target in done:
            try:
                fs.rm_file(target)
            except OSError:
                pass
        raise
