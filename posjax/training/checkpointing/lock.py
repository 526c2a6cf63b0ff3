"""One training run per workdir: ``exclusive(workdir)`` holds an exclusive lock on it.

Two runs in one workdir (a job resubmitted while the first still runs, two shells) would
interleave their checkpoints and metrics.jsonl records, and one would die inside an Orbax save.
So a run holds two ``flock`` locks for as long as it trains: one on ``<workdir>/train.lock``,
which also records the holder (NFS carries locks on regular files between machines), and one
on the workdir itself (a deleted ``train.lock`` must not let a second run in; NFS keeps this
one on the machine). A second run is refused before it writes anything, with one error naming
the holder. The kernel drops the locks when their holder ends, however it ends (SIGKILL and
the OOM killer included), so a lock is never stale. With several processes, process 0 holds
them for the run. Evaluation does not lock: evaluating checkpoints while training goes on is
what ``eval.py`` is for.
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


def _flock(fd: int) -> bool | None:
    """Take an exclusive lock on ``fd`` without waiting: True, False when another process
    holds it, None when the filesystem has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


def _lock_record(path: pathlib.Path) -> tuple[int, bool | None]:
    """(descriptor of the record file ``path``, ``_flock`` of it). A holder that ends
    removes the file: a lock taken on the removed file is dropped and the new one opened."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        locked = _flock(fd)
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        opened = os.fstat(fd)
        if not locked or (current and (current.st_dev, current.st_ino) ==
                          (opened.st_dev, opened.st_ino)):
            return fd, locked
        os.close(fd)


@contextlib.contextmanager
def exclusive(workdir: pathlib.Path, enabled: bool = True) -> Iterator[None]:
    """Hold the workdir's locks inside the block (a no-op when not ``enabled``: processes
    other than 0). ``workdir`` must exist. Raises ValueError when another run holds them."""
    if not enabled:
        yield
        return
    workdir = pathlib.Path(workdir)
    record = workdir / LOCK_FILE
    with contextlib.ExitStack() as held:   # closing a descriptor releases its lock
        directory_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
        held.callback(os.close, directory_fd)
        locks = [_flock(directory_fd)]
        if locks[0] is not False:
            record_fd, record_locked = _lock_record(record)
            held.callback(os.close, record_fd)
            locks.append(record_locked)
        if False in locks:
            try:
                holder = _describe(record.read_text(errors="replace"))
            except OSError:
                holder = _describe("")
            raise ValueError(
                f"workdir {str(workdir)!r} is in use by another training run ({holder}): wait "
                "for it to end, or stop it (SIGTERM saves a checkpoint) and start this run "
                "again to resume there; or use another --workdir")
        if locks == [None, None]:   # a filesystem without flock
            logging.warning("workdir %s: cannot lock it; make sure no other run trains in "
                            "this workdir", workdir)
        else:
            os.ftruncate(record_fd, 0)   # in place: the lock is on this file
            os.pwrite(record_fd, (_holder() + "\n").encode(), 0)
        try:
            yield
        finally:
            record.unlink(missing_ok=True)   # before the locks go: see _lock_record
