"""One training run per workdir: ``exclusive(workdir)`` holds ``<workdir>/train.lock``.

Two runs in one workdir (a job resubmitted while the first still runs, two shells) would
interleave their checkpoints and metrics.jsonl records, and one would die inside an Orbax save.
So a run takes an exclusive ``flock`` on the lock file for as long as it trains, and a second
run is refused before it writes anything, with one error naming the holder. The kernel drops
the lock when its holder ends, however it ends (SIGKILL and the OOM killer included), so a
lock is never stale. With several processes, process 0
holds it for the run. Evaluation does not lock: evaluating checkpoints while training goes on
is what ``eval.py`` is for.
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
    path = pathlib.Path(workdir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            holder = _describe(path.read_text(errors="replace"))
            raise ValueError(
                f"workdir {str(workdir)!r} is in use by another training run ({holder}; "
                f"{path}): wait for it to end, or stop it (SIGTERM saves a checkpoint) and "
                "start this run again to resume there; or use another --workdir") from None
        except OSError as e:   # a filesystem without flock (some network mounts)
            logging.warning("workdir %s: cannot lock %s (%s); make sure no other run trains "
                            "in this workdir", workdir, path, e.strerror)
            locked = False
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (_holder() + "\n").encode(), 0)
        yield
    finally:
        os.close(fd)   # releases the lock
