"""Pieces every input pipeline (images, MLM text, GLUE) shares."""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import multiprocessing.resource_tracker
import os
import pathlib
import signal
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import grain
import numpy as np

from posjax.io_utils import SHIELDED_SIGNALS

Example = dict[str, np.ndarray]


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


def utf8_lines(lines: Iterable[Any], path: str | pathlib.Path) -> Iterator[Any]:
    """``lines`` as they are: bytes (each checked; no UTF-8 character holds a newline byte, so
    lines decode on their own), or str from a file opened as UTF-8 (its decoding error is
    placed by reading the file again). A byte that is not UTF-8 raises one ValueError naming
    the file, the bytes and their line (``not_utf8_error``)."""
    lines = iter(lines)
    offset = number = 0
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except UnicodeDecodeError as chunk_error:   # its position is within a read chunk
            data = pathlib.Path(path).read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise not_utf8_error(path, e, line=line_at(data, e.start)) from e
            raise ValueError(f"{path}: was not valid UTF-8 while it was read (it has changed "
                             "since); read it again, and convert it to UTF-8 if it is not"
                             ) from chunk_error
        number += 1
        if isinstance(line, bytes):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise not_utf8_error(path, e, offset=offset, line=number) from e
            offset += len(line)
        yield line


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
