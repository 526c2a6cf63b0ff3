"""Checkpoints: train state + input-iterator state in one Orbax step directory.

``<workdir>/checkpoints/<step>/state`` (sharded arrays, restorable onto any mesh: the restore
target carries the new shardings) and ``<workdir>/checkpoints/<step>/data_iter`` (one Grain
iterator state file per process). Saves are asynchronous; ``every_steps`` and ``keep`` set the
interval and how many are kept. Preemption (SIGTERM) is honoured at the next step boundary:
single process via a signal flag (``StopRequest``, which a first Ctrl-C sets too),
multi-process via JAX's preemption sync point, so every process saves the same step.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import pathlib
import re
import shutil
import signal
import sys
import threading
import warnings
from typing import Any, Callable, Iterator, TypeVar

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from posjax.data.common import error_summary


class StopRequest:
    """Context: SIGTERM or a first Ctrl-C (SIGINT) asks the training loop to stop
    (``requested``): after the current step, with a checkpoint, once ``begin_steps`` was
    called; before the first step, with nothing new to save, before that. A second Ctrl-C
    aborts at once, status 130.

    Single process, main thread only; with several processes nothing is installed: JAX's
    preemption service owns SIGTERM (``Checkpointer.reached_preemption``), and Ctrl-C keeps
    Python's default, since a stop on one host alone would leave the others waiting in a
    collective. A signal the process ignores (``nohup``, a background job) stays ignored.

    Python runs signal handlers in the main thread between bytecodes, late when it is busy in a
    compile or a wait, and two signals that arrive meanwhile make one call. So each signal is
    also written to a wakeup pipe (``signal.set_wakeup_fd``) that a watcher thread reads: it
    sees every press at once."""

    def __init__(self):
        self.requested = False
        self._in_steps = False
        self._lock = threading.Lock()
        self._previous: dict[int, Any] = {}
        self._previous_fd: int | None = None
        self._pipe: tuple[int, int] | None = None

    def __enter__(self) -> "StopRequest":
        if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
            return self
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(signum) != signal.SIG_IGN:
                self._previous[signum] = signal.signal(signum, self._request)
        self._pipe = os.pipe()
        os.set_blocking(self._pipe[1], False)
        self._previous_fd = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(self._pipe[0],), name="stop-request",
                         daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._pipe[1])    # the watcher reads end-of-file and ends
            self._pipe = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def begin_steps(self) -> bool:
        """From now on a stop saves after the current step; returns whether a stop was
        requested before (the run then stops with nothing new to save)."""
        with self._lock:
            self._in_steps = True
            return self.requested

    def _watch(self, read_fd: int) -> None:
        interrupts = 0
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while byte := pipe.read(1):
                signum = byte[0]
                if signum == signal.SIGINT:
                    interrupts += 1
                    if interrupts >= 2:
                        print("aborted by Ctrl-C", file=sys.stderr, flush=True)
                        os._exit(130)
                if signum in self._previous:
                    self._request(signum)

    def _request(self, signum: int, frame: Any = None) -> None:
        """Python's handler (main thread) and the watcher's action: both see each signal."""
        with self._lock:
            if self.requested:
                return
            self.requested = True
            in_steps = self._in_steps
        what = ("will save a checkpoint after the current step and exit" if in_steps
                else "stopping before the first step; nothing new to save")
        again = ("" if signum != signal.SIGINT else
                 "; Ctrl-C again aborts without saving" if in_steps else
                 "; Ctrl-C again aborts at once")
        logging.warning("%s: %s%s", signal.Signals(signum).name, what, again)


class SaveFailed(RuntimeError):
    """A checkpoint, or another file of the run (``writing``), could not be written (a full
    disk, a folder no longer writable)."""


@contextlib.contextmanager
def writing(what: str) -> Iterator[None]:
    """An OSError inside, while ``what`` (naming the file) is written, raises one SaveFailed
    saying so and how to go on: the metrics log, an eval result, a plot fail this way when
    the disk fills (tracebacks from TensorBoard's writer, before)."""
    try:
        yield
    except OSError as e:
        raise SaveFailed(f"{what} could not be written ({type(e).__name__}: "
                         f"{e.strerror or e}): is the disk full, or the folder no longer "
                         "writable? Fix the storage, then run the command again (a training "
                         "run resumes from its latest checkpoint)") from e


# How TensorStore words a failed read or write of a file (it raises plain ValueErrors).
_STORAGE_STATUS = re.compile(r"os_error_code=|^(PERMISSION_DENIED|RESOURCE_EXHAUSTED|"
                             r"OUT_OF_RANGE|DATA_LOSS|UNAVAILABLE): ")


def _is_storage_error(error: BaseException | None) -> bool:
    """Whether ``error`` (or one in its chain) is the storage failing: an OSError, or
    TensorStore's word for one. Anything else (a bug, a peer process gone) is no SaveFailed."""
    while error is not None:
        if isinstance(error, OSError) or _STORAGE_STATUS.search(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


class _OrbaxErrorsOnOneLine(logging.Filter):
    """Orbax's error records without their tracebacks, one line each: a failed save logged
    four tracebacks (300+ lines) from its background threads; the run then raises one
    ``SaveFailed`` naming the step, the cause and the way out."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "/orbax/" in record.pathname:
            record.msg, record.args = short_error(record.getMessage()), ()
            record.exc_info = record.exc_text = record.stack_info = None
        return True


class Checkpointer:
    """Orbax CheckpointManager over ``<workdir>/checkpoints``; ``create``: for a training run
    (else an evaluation); ``stop``: the run's ``StopRequest`` (single process), read by
    ``reached_preemption``. A save that fails (now, or in the background: seen by
    ``check_background_save`` after a step, or at a log step with several processes; by the
    next save or a wait) raises ``SaveFailed``."""

    def __init__(self, workdir: str | pathlib.Path, every_steps: int, keep: int,
                 async_save: bool = True, create: bool = True, stop: StopRequest | None = None):
        self.directory = pathlib.Path(workdir).expanduser().resolve() / "checkpoints"
        # Save on the interval only (Orbax's default also saves the first step of every run);
        # preemption and the final step are saved with force=True.
        policy = ocp.checkpoint_managers.FixedIntervalPolicy(max(int(every_steps), 1))
        if create and jax.process_index() == 0:
            self._remove_partial_saves()
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policy, max_to_keep=int(keep) or None,
            enable_async_checkpointing=async_save, create=create)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data_iter"))
        self.stop = stop
        self._pending: int | None = None   # the step of a save begun and not waited for
        self._failed = False
        self._quiet = _OrbaxErrorsOnOneLine()
        logging.getLogger("absl").addFilter(self._quiet)
        _drop_closed_loop_callbacks()   # a failed write leaves callbacks into a closed loop

    def _remove_partial_saves(self) -> None:
        """Remove the partial saves of runs that died mid-save (<step>.orbax-checkpoint-tmp,
        full size), now, before this run saves. Only a training run (``create``) may: it holds
        the workdir lock, so no other run is saving; an evaluation must not, since the run it
        evaluates may be saving. (Orbax's own clean-up runs in a thread nothing waits for.)"""
        for partial in sorted(self.directory.glob("*.orbax-checkpoint-tmp*")):
            try:
                shutil.rmtree(partial)
            except OSError as e:
                logging.warning("cannot remove the partial save %s (%s); remove it by hand",
                                partial, e.strerror)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def due(self, step: int) -> bool:
        """Whether ``save(step, ...)`` without ``force`` would save."""
        return self.manager.should_save(step)

    def save(self, step: int, state: Any, data_iter: Any, force: bool = False) -> bool:
        """Save if ``step`` is on the interval (or ``force``); returns whether it saved."""
        with self._storage_failures(step):
            saved = self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data_iter=grain.checkpoint.CheckpointSave(data_iter)), force=force)
        if saved:
            self._pending = step
        return saved

    def check_background_save(self, synchronised: bool = False) -> None:
        """Between steps: once the last save has ended in the background, raise its failure
        (SaveFailed) now rather than at the next save, a save interval of steps later.

        With several processes a process's own view of "ended" must not decide a wait that the
        others do not make (it would block in Orbax's barrier): they check only where
        ``synchronised`` (a step at which every process makes this call: the log steps), and
        wait only when every process's save has ended (one all-gather of a flag). That is when
        every process's save failed (shared storage full). A save that failed on some hosts
        only leaves the others' saves waiting in Orbax's commit barrier: the next save then
        waits for them, up to Orbax's async timeout (20 minutes), before the run ends."""
        if self._pending is None:   # the same on every process: saves are taken in step
            return
        ended = not self.manager.is_saving_in_progress()
        if jax.process_count() > 1:
            if not synchronised:
                return
            ended = bool(np.all(multihost_utils.process_allgather(np.asarray(ended))))
        if ended:
            self.wait()

    @contextlib.contextmanager
    def _storage_failures(self, step: int | None) -> Iterator[None]:
        """The storage failing inside (now, or a background save before) raises SaveFailed;
        any other error passes unchanged. ``step``: the save begun inside, if any."""
        try:
            yield
        except Exception as e:   # noqa: BLE001 (Orbax and TensorStore raise plain Exception)
            if _is_storage_error(e):
                raise self._save_failed(step, e) from e
            raise

    def _save_failed(self, step: int | None, error: Exception) -> SaveFailed:
        """The error for a save that failed: the earliest of the pending and the given step
        not on disk, the cause, and what is still there. Its failed writes are not reported
        again (asyncio logs each when its task is collected, even at exit, and Python warns
        of those it never started)."""
        self._failed = True
        logging.getLogger("asyncio").addFilter(_MentionsPath(self.directory))
        warnings.filterwarnings("ignore", r"coroutine 'async_serialize", RuntimeWarning)
        try:
            on_disk = set(ocp.utils.checkpoint_steps(self.directory))
        except OSError:
            on_disk = set()
        missing = [s for s in (self._pending, step) if s is not None and s not in on_disk]
        failed = min(missing) if missing else step
        latest = max(on_disk, default=None)
        kept = (f"The checkpoints saved before are intact (the latest: step {latest}); fix "
                "the storage, then start this run again to resume from there" if latest is not
                None else "No checkpoint was complete yet; fix the storage, then start again")
        return SaveFailed(f"the checkpoint of step {failed} could not be written in "
                          f"{self.directory} ({_root_cause(error)}): is the disk full, or the "
                          f"folder no longer writable? {kept}")

    def restore(self, step: int, abstract_state: Any, data_iter: Any | None = None) -> Any:
        """State at ``step`` placed on ``abstract_state``'s shardings; ``data_iter`` (if given)
        is set to the saved position in place."""
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iter is not None:
            items["data_iter"] = grain.checkpoint.CheckpointRestore(data_iter)
        path = self.directory / str(step)
        if data_iter is not None:
            counts = {f.stem.rsplit("-of-", 1)[-1]
                      for f in (path / "data_iter").glob("process_*-of-*.json")}
            if counts and str(jax.process_count()) not in counts:
                raise ValueError(
                    f"checkpoint {path} holds input-iterator states for {', '.join(counts)} "
                    f"processes, not the current {jax.process_count()}: resume with the same "
                    "process count")
        # Before reading any array: a restore that fails on the tree leaves reads in flight.
        if differences := param_differences(path / "state", abstract_state.params):
            raise ValueError(
                f"checkpoint {path} holds the parameters of another model than config.model "
                f"builds ({'; '.join(differences)}): it was saved with another config. Use "
                "the config of the run that saved it (its config.json), or another "
                "--workdir; the checkpoint itself is not damaged")
        try:
            with failures_reported_once(path):
                restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:   # noqa: BLE001 (Orbax and TensorStore raise plain Exception)
            others = [s for s in self.manager.all_steps() if s != step]
            fallback = (f"to use step {max(others)} instead (eval.py: or --step {max(others)})"
                        if others else "and delete metrics.jsonl to start over")
            raise ValueError(
                f"checkpoint {path} cannot be restored ({_root_cause(e)}). If it is damaged "
                f"(a full disk, an interrupted copy), move it out of {self.directory} "
                f"{fallback}") from e
        return restored["state"]

    def wait(self) -> None:
        with self._storage_failures(None):
            self.manager.wait_until_finished()
        self._pending = None   # on disk

    def close(self) -> None:
        """Wait for the last save and close; after a ``SaveFailed``, only close (quietly)."""
        try:
            if not self._failed:
                self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:   # noqa: BLE001 -- the failure was raised once already
                if not self._failed:
                    raise
            finally:
                if not self._failed:   # else its threads may still log
                    logging.getLogger("absl").removeFilter(self._quiet)

    # -- preemption ---------------------------------------------------------------------------

    def reached_preemption(self, step: int) -> bool:
        """True once every process should save ``step`` and stop.

        Several processes: ``jax.distributed.initialize`` installs a SIGTERM handler (JAX's
        preemption service, on by default) that tells every process; Orbax's
        ``reached_preemption`` (JAX's ``reached_preemption_sync_point``, called every step) is
        then True on all processes at the same step, one past the largest step any had
        reached, whichever processes got the signal. tests/test_multiprocess.py signals one
        of two processes."""
        return bool(self.stop and self.stop.requested) or self.manager.reached_preemption(step)


def param_differences(state_dir: pathlib.Path, abstract_params: Any) -> list[str]:
    """How the ``params`` tree saved in ``state_dir`` (a step's ``state`` item) differs from
    ``abstract_params`` (anything with shapes): parameters the model has and the checkpoint
    lacks, the reverse, and other shapes, a few names each. Empty when they agree, or when
    the checkpoint's metadata cannot be read (a damaged checkpoint)."""
    try:
        saved = read_metadata_tree(state_dir).get("params")
    except ValueError:   # unreadable metadata: the restore's error says why
        return []
    if not isinstance(saved, dict):
        return []

    def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
        return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
                for path, leaf in leaves[0]}

    ours, theirs = shapes(abstract_params), shapes(saved)
    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
    out = []
    if missing := sorted(set(ours) - set(theirs)):
        out.append(f"not in the checkpoint: {few(missing)}")
    if extra := sorted(set(theirs) - set(ours)):
        out.append(f"not in the model: {few(extra)}")
    if other := [f"{k} {theirs[k]} saved, {ours[k]} in the model"
                 for k in sorted(set(ours) & set(theirs)) if ours[k] != theirs[k]]:
        out.append(f"other shapes: {few(other)}")
    return out


def _root_cause(error: BaseException) -> str:
    """The innermost exception in ``error``'s chain: its type and the first line of its
    message (``error_summary``, shortened by ``short_error``)."""
    while True:
        inner = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if inner is None:
            break
        error = inner
    return short_error(error_summary(error))


def short_error(text: str) -> str:
    """The first line of an error's ``text`` without TensorStore's spec dump, at most 500
    characters."""
    line = (text.strip().splitlines() or [""])[0]
    line = re.sub(r"\s*\[tensorstore_spec(\[\d+\])?='.*$", "", line)
    return line if len(line) <= 500 else line[:497] + "..."


class _MentionsPath(logging.Filter):
    """Drops log records whose text names a file under ``path``."""

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.path = str(pathlib.Path(path).expanduser().resolve())   # as TensorStore names it

    def filter(self, record: logging.LogRecord) -> bool:
        return self.path + os.sep not in record.getMessage()


def _is_callback_into_closed_loop(unraisable: Any) -> bool:
    """A TensorStore read finishing after Orbax closed the event loop that awaited it."""
    error, frames = unraisable.exc_value, unraisable.exc_traceback
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        return False
    while frames is not None:
        if frames.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        frames = frames.tb_next
    return False


def _drop_closed_loop_callbacks() -> None:
    """Install (once) an unraisable hook that drops ``_is_callback_into_closed_loop``."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_callbacks", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_callback_into_closed_loop(unraisable):
            previous(unraisable)
    hook.drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


@contextlib.contextmanager
def failures_reported_once(path: pathlib.Path) -> Iterator[None]:
    """Around a read of the checkpoint at ``path`` whose failure the caller reports: drop the
    echoes of that failure.

    Orbax awaits all of a checkpoint's array reads at once and closes its event loop when the
    first fails. The other reads of the same damaged files then fail too, each logged by
    asyncio as "exception was never retrieved" (with a multi-kilobyte TensorStore spec) when
    its task is collected, which may be before or after the error reaches the caller; and
    reads still in flight call back into the closed loop ("Event loop is closed", printed as
    an unraisable exception). A damaged checkpoint printed tens of kilobytes of both around
    the one error that names it. Dropped: asyncio records that name ``path`` (from the read
    on; for good once it failed) and callbacks into a closed event loop."""
    echoes = _MentionsPath(path)
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addFilter(echoes)
    _drop_closed_loop_callbacks()
    try:
        yield
    except Exception:
        with warnings.catch_warnings():   # and reads it never started, as coroutines
            warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
            gc.collect()   # the failed tasks are reported now, while the filter is in place
        raise
    asyncio_log.removeFilter(echoes)


T = TypeVar("T")


def read_metadata_tree(directory: pathlib.Path) -> dict[str, Any]:
    """The saved tree of one Orbax item folder (``read_item``) as metadata: shapes and dtypes,
    no arrays read."""
    meta = read_item(directory, ocp.PyTreeCheckpointHandler(),
                     lambda handler: handler.metadata(directory))
    return dict(getattr(meta, "tree", meta))


def read_item(directory: pathlib.Path, handler: Any, read: Callable[[Any], T]) -> T:
    """``read(handler)`` on one Orbax item folder: a converter's ``params/``, or the ``state``
    item of a train.py step, whose checkpoint-level metadata file is one level up (so a
    Checkpointer would warn that it is missing; the item's handler does not). The handler is
    closed after; a missing or damaged item raises one ValueError naming the folder."""
    try:
        with failures_reported_once(directory):
            return read(handler)
    except Exception as e:   # noqa: BLE001 -- Orbax raises assorted errors for such files
        raise ValueError(f"{directory}: cannot read this checkpoint "
                         f"({_root_cause(e)}); if it is damaged (a full disk, "
                         "an interrupted copy), copy or convert it again") from e
    finally:
        handler.close()
