"""A study whose ``--workdir`` is a Cloud Storage folder (``gs://bucket/study``).

Its cells train in a local folder (their checkpoints and the compile cache are scratch that
no other machine needs: ``local_folder``); what the study is for lives on the bucket:
``results/`` (every cell's JSON, curves and analysis arrays, the manifest, the baselines and
the cost) and the report (``report.md``, ``report.json``, the figures). ``pull`` copies the
bucket's results down before the grid runs (a study resumes on another machine: finished
cells are not run again), ``push`` uploads what changed after each cell and after the report.
A cell interrupted mid-training resumes from its checkpoint only on the machine that ran it;
elsewhere it starts again.
"""
from __future__ import annotations

import hashlib
import os
import pathlib

from posjax import storage

SHARED_FOLDER = "results"


def local_folder(url: str) -> pathlib.Path:
    """``$POSJAX_STUDY_CACHE`` (default ``~/.cache/posjax/studies``) / bucket / path."""
    base = os.environ.get("POSJAX_STUDY_CACHE") or pathlib.Path.home() / ".cache/posjax/studies"
    bucket, _, key = url[len("gs://"):].partition("/")
    return pathlib.Path(base, bucket, *key.strip("/").split("/")).absolute()


def _shared(name: str) -> bool:
    """Whether the workdir-relative file ``name`` is kept on the bucket: results/, and the
    report's files at the top (not the cells' scratch)."""
    top = "/" not in name
    return name.startswith(SHARED_FOLDER + "/") or (top and (name.startswith("report")
                                                             or name.endswith(".png")))


def pull(url: str, local: pathlib.Path) -> dict[str, str]:
    """Copy the bucket's shared files into ``local`` (replacing local copies); -> name ->
    digest of each (what ``push`` need not upload again)."""
    pulled = {}
    for name in (n for n in storage.files(url) if _shared(n)):
        found = storage.read_with_generation(f"{url}/{name}")
        if found is not None:
            target = local / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(found[0])
            pulled[name] = hashlib.sha256(found[0]).hexdigest()
    return pulled


def push(local: pathlib.Path, url: str, pushed: dict[str, str]) -> int:
    """Upload ``local``'s shared files whose bytes changed since the last push (``pushed``:
    name -> digest, updated in place); -> how many were uploaded."""
    uploaded = 0
    top = sorted(p.name for p in local.iterdir() if p.is_file()) if local.is_dir() else []
    results = local / SHARED_FOLDER   # not the cells' checkpoints or the compile cache
    below = [f"{SHARED_FOLDER}/{n}" for n in storage.files(results)] if results.is_dir() else []
    for name in filter(_shared, top + below):
        data = (local / name).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if pushed.get(name) != digest:
            storage.write_atomically(f"{url}/{name}", data)
            pushed[name] = digest
            uploaded += 1
    return uploaded
