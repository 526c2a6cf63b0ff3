"""One training run per workdir: ``exclusive(workdir)`` holds an exclusive lock on it.

Two runs in one workdir (a job resubmitted while the first still runs, two shells) would
interleave their checkpoints and metrics.jsonl records, and one would die inside an Orbax save.
So a run takes an exclusive ``flock`` on the workdir itself for as long as it trains (a lock
file could be deleted under it), and records itself in ``<workdir>/train.lock``; a second run
is refused before it writes anything, with one error naming the holder. The kernel drops the
lock when its holder ends, however it ends (SIGKILL and the OOM killer included), so a lock is
never stale. With several processes, process 0 holds it for the run. Evaluation does not
lock: evaluating checkpoints while training goes on is what ``eval.py`` is for.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import pathlib
import socket
from typing import Iterator

from posjax.data.common import write_text_atomically

LOCK_FILE = "train.lock"


def _holder() -> str:
    """This process, as the lock file records it."""
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": started})


def _describe(text: str) -> str:
    """The holder recorded in a lock file, in words (the file may be empty or mid-write)."""
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']}, since {holder['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not recorded itself yet"


@contextlib.contextmanager
def exclusive(workdir: pathlib.Path, enabled: bool = True) -> Iterator[None]:
    """Hold the workdir's lock inside the block (a no-op when not ``enabled``: processes
    other than 0). ``workdir`` must exist. Raises ValueError when another run holds it."""
    if not enabled:
        yield
        return
    workdir = pathlib.Path(workdir)
    record = workdir / LOCK_FILE
    fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            try:
                holder = _describe(record.read_text(errors="replace"))
            except OSError:
                holder = _describe("")
            raise ValueError(
                f"workdir {str(workdir)!r} is in use by another training run ({holder}): wait "
                "for it to end, or stop it (SIGTERM saves a checkpoint) and start this run "
                "again to resume there; or use another --workdir") from None
        except OSError as e:   # a filesystem without flock (some network mounts)
            logging.warning("workdir %s: cannot lock it (%s); make sure no other run trains "
                            "in this workdir", workdir, e.strerror)
            locked = False
        if locked:
            write_text_atomically(record, _holder() + "\n")
        try:
            yield
        finally:
            if locked:
                record.unlink(missing_ok=True)
    finally:
        os.close(fd)   # releases the lock
