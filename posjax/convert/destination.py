"""Write an output folder all-or-nothing: fill a hidden sibling, then rename it into place."""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from typing import Callable

from posjax.io_utils import check_creatable, local_path


def new_destination(dest: str | pathlib.Path, what: str = "destination") -> pathlib.Path:
    """``dest`` as an absolute local path; one ValueError (naming ``what``) if it is empty or
    a URL, if it exists already, or if it cannot be created (under a file, not writable)."""
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
