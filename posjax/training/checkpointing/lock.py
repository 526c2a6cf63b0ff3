"""One training run per workdir: ``exclusive(workdir)`` holds an exclusive lock on it.

Two runs in one workdir (a job resubmitted while the first still runs, two shells) would
interleave their checkpoints and metrics.jsonl records, and one would die inside an Orbax save.
So a run holds two ``flock`` locks for as long as it trains: one on ``<workdir>/train.lock``,
which also records the holder (NFS carries locks on regular files between machines), and one
on the workdir itself (a deleted ``train.lock`` must not let a second run in; NFS keeps this
one on the machine). A second run is refused before it writes anything, with one error naming
the holder. The kernel drops the locks when their holder ends, however it ends (SIGKILL and
the OOM killer included), so a lock is never stale. With several processes, process 0 holds
them for the run. On a bucket (``gs://``) a lease object takes their place
(``storage.bucket_lease``): ``check_held`` stops the run once it is lost. Evaluation does not
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
import threading
import time
from typing import Iterator

from posjax import storage
from posjax.io_utils import SaveFailed
from posjax.training import hosts

LOCK_FILE = storage.LOCK_FILE
# A bucket's lease (``storage.bucket_lease``): renewed every LEASE_RENEW_S, expiring
# LEASE_EXPIRE_S after its last renewal.
LEASE_RENEW_S, LEASE_EXPIRE_S = 10.0, 30.0
_lease_lost: threading.Event | None = None   # set once this process's bucket lease is lost


def check_held(bucket: bool = False) -> None:
    """SaveFailed once this run's lease on its bucket workdir is lost (taken over by another
    run after it went unrenewed for LEASE_EXPIRE_S): it must not write there any more. With
    several processes on a ``bucket`` every process calls it at the same step (a save) and
    learns process 0's lease (one all-gather), so that all of them stop there together."""
    lost = _lease_lost is not None and _lease_lost.is_set()
    if bucket and hosts.several():
        lost = any(hosts.gather(lost))
    if lost:
        raise SaveFailed("this run lost its lease on the workdir (train.lock was not renewed "
                         f"for {LEASE_EXPIRE_S:.0f} s, or another run took it over): stopped "
                         "before writing more; make sure no other run trains there, then start "
                         "this run again to resume from its latest checkpoint")


@contextlib.contextmanager
def _bucket_lease(workdir: os.PathLike) -> Iterator[None]:
    """``storage.bucket_lease`` on ``workdir``; a lease renewed less than LEASE_EXPIRE_S ago
    is tried again until that long has passed (a run killed moments ago, whose lease no one
    renews, is then taken over); a holder seen renewing it meanwhile is alive, and this run is
    refused then (within LEASE_RENEW_S)."""
    global _lease_lost
    deadline, waiting, lost = time.monotonic() + LEASE_EXPIRE_S + LEASE_RENEW_S, False, None
    record, first_seen = f"{os.fspath(workdir).rstrip('/')}/{LOCK_FILE}", None
    with contextlib.ExitStack() as held:
        while lost is None:
            try:
                lost = held.enter_context(
                    storage.bucket_lease(workdir, LEASE_RENEW_S, LEASE_EXPIRE_S))
            except ValueError:
                found = storage.read_with_generation(record)
                generation = found[1] if found else None
                first_seen = first_seen or generation
                if time.monotonic() >= deadline or generation not in (first_seen, None):
                    raise
                if not waiting:
                    logging.warning("workdir %s: its lease is held; trying again for up to "
                                    "%.0f s (its holder may have ended)", os.fspath(workdir),
                                    LEASE_EXPIRE_S + LEASE_RENEW_S)
                waiting = True
                time.sleep(min(LEASE_RENEW_S, 1.0))
        _lease_lost = lost
        try:
            yield
        finally:
            _lease_lost = None


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
    if storage.is_bucket(workdir):   # no flock on a bucket: a lease (storage.bucket_lease)
        with _bucket_lease(workdir):
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
