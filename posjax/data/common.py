"""Pieces every input pipeline (images, MLM text, GLUE) shares."""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import glob
import multiprocessing.resource_tracker
import os
import pathlib
import re
import signal
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import grain
import numpy as np

Example = dict[str, np.ndarray]


SHIELDED_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_receiver: threading.Thread | None = None


@contextlib.contextmanager
def signals_to_receiver_thread() -> Iterator[None]:
    """Inside: SIGTERM and SIGINT reach the process through one daemon thread started for the
    purpose; the calling thread blocks them, and so does every thread or process started inside
    (they inherit the block). Python still runs the handlers in the main thread, as always.

    This closes the start-up window of input workers: a SIGTERM sent to the whole process group
    while a worker is still importing (about 2 s) would otherwise kill it with the default
    action before ``input_worker_init`` runs, and the main process would wait for its batches
    forever. Signals that arrive meanwhile are not lost; the block ends on exit."""
    global _receiver
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    if _receiver is None:   # started with the caller's (unblocked) mask, lives for the process
        _receiver = threading.Thread(target=threading.Event().wait, name="signal-receiver",
                                     daemon=True)
        _receiver.start()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_waits_at_exit = False      # prepare_input_workers registered wait_for_shared_memory_release


def prepare_input_workers() -> None:
    """Call before a pipeline starts Grain worker processes.

    - Starts multiprocessing's resource tracker now, keeping the calling thread's signal mask.
      CPython 3.11 blocks SIGTERM and SIGINT to start the tracker and then unblocks them in the
      starting thread. Started lazily from the Grain thread that spawns the first worker, it
      would lift ``signals_to_receiver_thread``'s block there, and that thread would spawn the
      workers unprotected.
    - Has the process wait at exit until Grain has freed the batches it received
      (``wait_for_shared_memory_release``)."""
    global _waits_at_exit
    if not _waits_at_exit:
        atexit.register(wait_for_shared_memory_release)
        _waits_at_exit = True
    if not hasattr(signal, "pthread_sigmask"):
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    multiprocessing.resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def wait_for_shared_memory_release() -> None:
    """Collect unreachable batches and wait until Grain has unlinked their shared memory.

    Grain's worker processes hand batches over in shared-memory blocks. The main process unlinks
    a block when its array is freed, on a background thread; blocks still queued there when the
    process ends stay behind for the resource tracker, which frees them with a warning about
    "leaked shared_memory objects". Close the pipelines' iterators first: that frees the
    batches the workers had prefetched."""
    gc.collect()
    try:   # Grain has no public handle on that thread; another version: nothing to wait for
        from grain._src.python.ipc.shared_memory_array import SharedMemoryArray
        pool = SharedMemoryArray._del_thread_pool
    except (ImportError, AttributeError):
        return
    if pool is not None:
        with contextlib.suppress(ValueError):   # a pool already closed has nothing queued
            pool.apply(int)   # one thread, first in first out: every earlier unlink has run


def input_worker_init(worker_index: int, worker_count: int) -> None:
    """Runs first in every Grain worker process: the worker is the main process's helper, so
    the main process alone decides when it ends.

    - SIGTERM and SIGINT sent to the whole process group (``timeout``, Slurm, Ctrl-C) are
      ignored while the main process lives: it saves a checkpoint first, which may need a few
      more batches, and then closes its pipelines or exits; Grain stops the workers either way.
      A worker started inside ``signals_to_receiver_thread`` (train.py, eval.py) has them
      blocked from its first instruction; they are unblocked here, once ignored.
    - A worker whose main process is gone (killed, or ended by ``os._exit``) exits within a
      second instead of lingering.
    """
    del worker_index, worker_count
    main_pid = os.getppid()

    def on_signal(signum: int, frame: Any) -> None:
        if os.getppid() != main_pid:
            os._exit(0)

    def exit_when_orphaned() -> None:
        while os.getppid() == main_pid:
            time.sleep(0.5)
        os._exit(0)

    for signum in SHIELDED_SIGNALS:
        signal.signal(signum, on_signal)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED_SIGNALS)
    threading.Thread(target=exit_when_orphaned, name="exit-when-orphaned", daemon=True).start()


def check_pipeline_call(split: str, batch_size: int, seed: int, shard_index: int,
                        shard_count: int) -> None:
    """One ValueError naming the argument when a pipeline is asked for something impossible."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: choose 'train' or 'test'")
    if not (isinstance(batch_size, int) and batch_size > 0):
        raise ValueError(f"batch_size={batch_size!r}: must be a positive integer")
    if not (isinstance(seed, int) and 0 <= seed < 2**32):
        raise ValueError(f"seed={seed!r}: must be an integer in [0, 2**32)")
    if not (isinstance(shard_count, int) and shard_count >= 1
            and isinstance(shard_index, int) and 0 <= shard_index < shard_count):
        raise ValueError(f"shard_index={shard_index!r}, shard_count={shard_count!r}: need "
                         "0 <= shard_index < shard_count (use jax.process_index/_count)")


def key_problems(cfg: Mapping[str, Any], defaults: Mapping[str, Any], start_from: str
                 ) -> list[str]:
    """Keys of a data config that ``defaults`` (every valid key) lacks or has but ``cfg`` does
    not, as 'what: fix' lines (empty when the keys match): a misspelt key would otherwise be
    ignored silently and its default used."""
    out = []
    missing = sorted(set(defaults) - set(cfg))
    if missing:
        out.append(f"keys {missing} are missing: start from {start_from}")
    unknown = sorted(set(cfg) - set(defaults))
    if unknown:
        out.append(f"unknown key(s) {', '.join(f'data.{k}' for k in unknown)}: the data config "
                   f"has no such field; the valid keys are {', '.join(sorted(defaults))}")
    return out


def error_summary(error: BaseException) -> str:
    """``Type: first line of the message``: TFDS's DatasetNotFoundError lists every dataset it
    knows (~250 lines) after its first line."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_path(value: str | os.PathLike, what: str) -> pathlib.Path:
    """``value`` as an absolute local path (``~`` expanded). A URL (``gs://``, ``s3://``, ...)
    is one ValueError naming ``what``: runs read and write their folders through the file
    system (a file lock, atomic renames), and pathlib would turn ``gs://b/x`` into a local
    folder ``gs:/b/x``."""
    text = os.fspath(value)
    if not text.strip():
        raise ValueError(f"{what} is empty (an unset shell variable?): give a path")
    if _URL.match(text):
        raise ValueError(f"{what}={text!r} is a URL, but posjax opens its folders through "
                         "the file system (a workdir needs file locks and atomic renames): give "
                         "a local path, or on several hosts a shared file system every host "
                         "mounts (NFS, Filestore)")
    return pathlib.Path(text).expanduser().resolve()


def check_creatable(path: pathlib.Path, what: str) -> None:
    """One ValueError naming ``what`` unless ``path`` is a directory this process can write
    in, or can be created as one (its nearest existing ancestor is such a directory)."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what} {str(path)!r}: {str(existing)!r} is a file, not a "
                         f"directory; choose another {what}")
    why = cannot_write_in(existing)
    if why:
        raise ValueError(f"{what} {str(path)!r} is not writable ({str(existing)!r}: {why}); "
                         "choose a directory you can write to")


def cannot_write_in(directory: pathlib.Path) -> str | None:
    """Why no file can be created in ``directory`` (None if one can)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as e:
        return e.strerror


def write_atomically(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """``write(tmp)`` into a temporary file in ``path``'s folder, then ``os.replace`` it onto
    ``path``: a crash leaves the old file or the new one, never a partial one. The file gets
    the usual permissions (0666 less the umask), readable by others on shared storage.

    The temporary file is ``.<name>.<host>.<pid namespace>.<pid>.tmp``; those a killed writer
    of this host and PID namespace left for the same ``path`` are removed first (a SIGKILL
    mid-write cannot clean up after itself).
    """
    prefix = f".{path.name}.{_pid_space()}."
    _remove_abandoned(path.parent, prefix)
    tmp = path.with_name(f"{prefix}{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pid_space() -> str:
    """Where a pid names one process: this host and PID namespace (containers sharing a host
    name, with host networking, have PID namespaces of their own)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:   # not Linux
        namespace = 0
    return f"{socket.gethostname()}.{namespace}"


def _remove_abandoned(folder: pathlib.Path, prefix: str) -> None:
    """Remove ``folder/<prefix><pid>.tmp`` files whose writer is gone (``prefix`` names this
    host and PID namespace, where the pid means one process)."""
    for tmp in folder.glob(glob.escape(prefix) + "*.tmp"):
        pid = tmp.name[len(prefix):-len(".tmp")]
        if pid.isdigit() and not _process_exists(int(pid)):
            tmp.unlink(missing_ok=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


def write_text_atomically(path: pathlib.Path, text: str) -> None:
    """``text`` into ``path`` (UTF-8), atomically (``write_atomically``)."""
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def not_utf8_error(path: str | pathlib.Path, error: UnicodeDecodeError, *, offset: int = 0,
                   line: int | None = None) -> ValueError:
    """The one error for a file that is not UTF-8: ``path``, the bad bytes (``error``'s
    offsets, plus ``offset`` when ``error`` decoded a piece of the file starting there) and
    their ``line`` when known (``line_at``)."""
    where = f"line {line}, " if line is not None else ""
    return ValueError(f"{path}: {where}bytes {offset + error.start}..{offset + error.end} are "
                      "not valid UTF-8; convert the file to UTF-8")


def line_at(data: bytes, offset: int) -> int:
    """The line (from 1) holding byte ``offset`` of ``data``; lines end at \\n, \\r\\n or \\r."""
    before = data[:offset]
    return len(before.splitlines()) + (not before or before.endswith((b"\n", b"\r")))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def eval_batches_per_shard(num_examples: int, shard_count: int, batch_size: int) -> int:
    """Batches of one evaluation pass, equal on every shard (the short shards pad)."""
    return ceil_div(ceil_div(num_examples, shard_count), batch_size)


def pad_to_full_batches(shard: grain.MapDataset, num_batches: int, batch_size: int,
                        mark: Callable[..., Example]) -> grain.MapDataset:
    """One evaluation pass over ``shard`` as exactly ``num_batches`` full batches: the shard is
    repeated and cut to ``num_batches · batch_size`` examples, and ``mark(example, real=...)``
    tells the real ones from the repeats (``real=False`` at positions >= len(shard))."""
    padded = num_batches * batch_size
    return shard.repeat(ceil_div(padded, len(shard)))[:padded].map_with_index(
        functools.partial(_mark_real, num_real=len(shard), mark=mark))


def _mark_real(index: int, example: Example, *, num_real: int,
               mark: Callable[..., Example]) -> Example:
    return mark(example, real=index < num_real)


def stack_examples(examples: Sequence[Example]) -> Example:
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}
