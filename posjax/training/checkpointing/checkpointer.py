"""Saving and restoring checkpoints (``Checkpointer``): train state + input-iterator state in
one Orbax step directory.

``<workdir>/checkpoints/<step>/state`` (sharded arrays, restorable onto any mesh: the restore
target carries the new shardings) and ``<workdir>/checkpoints/<step>/data_iter`` (one Grain
iterator state file per process; a step saved by another number of processes resumes at
their one global input position, ``input_position``). Saves are asynchronous; ``every_steps``
and ``keep`` set the interval and how many are kept. Preemption (SIGTERM) is honoured at the next step boundary:
single process via a signal flag (``StopRequest``, which a first Ctrl-C sets too),
multi-process via JAX's preemption sync point, so every process saves the same step.

Each committed step gets its integrity record (``integrity.write_record``: every file read back
for its CRC-32) on process 0 in a background thread, never on the training thread: the record
of step s is begun once Orbax has committed s, and waited for before the next save begins (so
``checkpoint.keep`` never rotates out a step being read) and when the checkpointer closes (so a
run that ends or is preempted returns with its last step recorded). A process killed between
a commit and its record leaves the step without one: a resume then checks it by reading it
(``integrity``), it is not discarded.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import pathlib
import re
import shutil
import warnings
from typing import TYPE_CHECKING, Any, Iterator

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from posjax import checkpoint_io, storage
from posjax.io_utils import SaveFailed, storage_question
from posjax.training import hosts
from posjax.training.checkpointing import input_position, integrity, lock

if TYPE_CHECKING:
    from posjax.training.stop_request import StopRequest


class DamagedStep(ValueError):
    """A saved step that cannot be restored: ``reason`` (missing, truncated, checksum,
    unreadable, wrong-tree, non-finite) names it in ``<step>.damaged-<reason>``."""

    def __init__(self, step: int, reason: str, message: str):
        super().__init__(message)
        self.step, self.reason = step, reason


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
            record.msg, record.args = checkpoint_io.short_error(record.getMessage()), ()
            record.exc_info = record.exc_text = record.stack_info = None
        return True


class _EchoesOfFailedSave(checkpoint_io.MentionsPath):
    """After a save failed: asyncio's reports of its other writes, logged when their tasks are
    collected (even at exit): those naming a file under the checkpoints, and those whose
    exception is the storage error already reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return super().filter(record) and not _is_storage_error(error)


class Checkpointer:
    """Orbax CheckpointManager over ``<workdir>/checkpoints``; ``create``: for a training run
    (else an evaluation); ``stop``: the run's ``StopRequest`` (single process), read by
    ``reached_preemption``. A save that fails (now, or in the background: seen by
    ``check_background_save`` after a step, or at a log step with several processes; by the
    next save or a wait) raises ``SaveFailed``."""

    def __init__(self, workdir: str | pathlib.Path, every_steps: int, keep: int,
                 async_save: bool = True, create: bool = True, stop: StopRequest | None = None):
        self.directory = storage.as_path(workdir, "--workdir") / "checkpoints"
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
        # Process 0's integrity records, one at a time, off the training thread.
        self._recorder = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="posjax-integrity")
        self._record: concurrent.futures.Future | None = None   # the record being written
        self._failed = False
        self._quiet = _OrbaxErrorsOnOneLine()
        logging.getLogger("absl").addFilter(self._quiet)
        # A failed write leaves callbacks into a closed event loop.
        checkpoint_io.drop_closed_loop_callbacks()

    def _remove_partial_saves(self) -> None:
        """Remove the partial saves of runs that died mid-save (<step>.orbax-checkpoint-tmp,
        full size), now, before this run saves. Only a training run (``create``) may: it holds
        the workdir lock, so no other run is saving; an evaluation must not, since the run it
        evaluates may be saving. (Orbax's own clean-up runs in a thread nothing waits for.)
        On a bucket: ``integrity.partial_saves``."""
        for partial in integrity.partial_saves(self.directory):
            try:
                partial.rmtree() if storage.is_bucket(partial) else shutil.rmtree(partial)
            except OSError as e:
                logging.warning("cannot remove the partial save %s (%s); remove it by hand",
                                partial, e.strerror)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def due(self, step: int) -> bool:
        """Whether ``save(step, ...)`` without ``force`` would save."""
        return self.manager.should_save(step)

    def save(self, step: int, state: Any, data_iter: Any, force: bool = False) -> bool:
        """Save if ``step`` is on the interval (or ``force``); returns whether it saved. The
        save before is waited for first (Orbax would wait too), and its integrity record:
        this save may rotate out older steps (``keep``). A lost lease on a bucket workdir
        raises SaveFailed (``lock.check_held``)."""
        if force or self.due(step):
            lock.check_held(storage.is_bucket(self.directory))
            if self._pending is not None:
                self.wait()
            self.wait_for_record()
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
        logging.getLogger("asyncio").addFilter(_EchoesOfFailedSave(self.directory))
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
                          f"{self.directory} ({checkpoint_io.root_cause(error)}): "
                          f"{storage_question(storage.is_bucket(self.directory))} {kept}")

    def restore(self, step: int, abstract_state: Any, data_iter: Any | None = None) -> Any:
        """State at ``step`` placed on ``abstract_state``'s shardings; ``data_iter`` (if given)
        is set to the saved position in place. A step that does not match its integrity
        record, holds another tree or cannot be read raises ``DamagedStep``."""
        path = self.directory / str(step)
        if found := hosts.process_0_view(lambda: integrity.damage(path)):
            raise DamagedStep(step, found[0], f"checkpoint {path} cannot be restored "
                              f"({found[1]}). {self._way_out(step)}")
        position = (None if data_iter is None else
                    input_position.saved_by_others(path, jax.process_count()))
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iter is not None and position is None:
            items["data_iter"] = grain.checkpoint.CheckpointRestore(data_iter)
        # Before reading any array: a restore that fails on the tree leaves reads in flight.
        if differences := checkpoint_io.param_differences(path / "state", abstract_state.params):
            raise DamagedStep(step, "wrong-tree",
                f"checkpoint {path} holds the parameters of another model than config.model "
                f"builds ({'; '.join(differences)}): it was saved with another config. Use "
                "the config of the run that saved it (its config.json), or another "
                "--workdir; the checkpoint itself is not damaged")
        try:
            with checkpoint_io.failures_reported_once(path):
                restored = self.manager.restore(step, args=ocp.args.Composite(**items))
                if position is not None:   # saved by another process count: the one position
                    data_iter.set_state(json.loads(position))
                    data_iter.start_prefetch()
        except Exception as e:   # noqa: BLE001 (Orbax and TensorStore raise plain Exception)
            raise DamagedStep(step, "unreadable",
                f"checkpoint {path} cannot be restored ({checkpoint_io.root_cause(e)}). "
                f"{self._way_out(step)}") from e
        return restored["state"]

    def _way_out(self, step: int) -> str:
        others = [s for s in self.manager.all_steps() if s != step]
        fallback = (f"to use step {max(others)} instead (eval.py: or "
                    f"--config.eval_step={max(others)})"
                    if others else "and delete metrics.jsonl to start over")
        return (f"If it is damaged (a full disk, an interrupted copy), move it out of "
                f"{self.directory} {fallback}")

    def record_integrity(self, step: int | None) -> None:
        """Process 0: begin writing ``step``'s integrity record (Orbax has committed it) in
        the background; the record before is waited for first."""
        if step is None or jax.process_index() != 0 or self._failed:
            return
        self.wait_for_record()
        self._record = self._recorder.submit(integrity.record_once, self.directory / str(step))

    def wait_for_record(self) -> None:
        """Until the integrity record begun last is written (or skipped: see
        ``integrity.write_record``)."""
        record, self._record = self._record, None
        if record is not None:
            record.result()

    def wait(self) -> None:
        """Until the save begun last is committed; its integrity record is begun."""
        with self._storage_failures(None):
            self.manager.wait_until_finished()
        self.record_integrity(self._pending)
        self._pending = None   # on disk

    def close(self) -> None:
        """Wait for the last save and its integrity record, and close; after a ``SaveFailed``,
        only close (quietly)."""
        try:
            if not self._failed:
                self.wait()
            self.wait_for_record()   # the last step's record lands before the run returns
        finally:
            self._recorder.shutdown()
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
