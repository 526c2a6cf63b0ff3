"""Stopping on SIGTERM or Ctrl-C, and what a failed checkpoint save reports."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from posjax.training.checkpointing import checkpointer as ckpt_lib
from posjax.training import stop_request


def _wait_for(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)    # the main thread runs Python signal handlers between bytecodes
    return predicate()


def test_stop_request_is_set_by_sigterm_or_ctrl_c_and_restores_the_handlers(terminal_signals):
    """(A second Ctrl-C ends the process: tests/test_train_cli.py checks it in a subprocess.)"""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGTERM):
        with stop_request.StopRequest() as stop:
            assert not stop.requested
            os.kill(os.getpid(), signum)
            assert _wait_for(lambda: stop.requested)
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)   # nohup: stays ignored
    try:
        with stop_request.StopRequest() as stop:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) != before[1]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_after_a_failed_save_asyncio_echoes_of_its_writes_are_dropped(tmp_path):
    """A write task of the failed save collected late is logged by asyncio as 'Task exception
    was never retrieved' with a traceback (its message names no file, its exception is the
    storage error): dropped, as are records naming the checkpoints; anything else is kept."""
    import logging
    import sys

    echoes = ckpt_lib._EchoesOfFailedSave(tmp_path)

    def record(message, error=None):
        exc_info = None
        if error is not None:
            try:
                raise error
            except type(error):
                exc_info = sys.exc_info()
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, (), exc_info)

    late = "Task exception was never retrieved\nfuture: <Task finished coro=<Store.write() done>>"
    assert not echoes.filter(record(late, OSError(27, "File too large")))
    assert not echoes.filter(record(f"reading {tmp_path.resolve() / '2' / 'state'} failed"))
    assert echoes.filter(record(late, ZeroDivisionError("a bug")))
    assert echoes.filter(record("another folder's write failed"))


def test_a_save_that_fails_for_another_reason_than_storage_is_no_save_failed(tmp_path):
    """SaveFailed says 'is the disk full?': a bug (here a state Orbax cannot save) keeps its own
    error and traceback instead."""
    import grain
    checkpointer = ckpt_lib.Checkpointer(tmp_path, every_steps=1, keep=0, async_save=False)
    iterator = iter(grain.MapDataset.range(4).to_iter_dataset())
    try:
        with pytest.raises(Exception) as raised:
            checkpointer.save(1, {"weights": np.ones(2), "note": object()}, iterator)
        assert not isinstance(raised.value, ckpt_lib.SaveFailed), raised.value
        assert not ckpt_lib._is_storage_error(raised.value)
    finally:
        checkpointer.close()
    assert ckpt_lib._is_storage_error(OSError(28, "No space left on device"))
    assert ckpt_lib._is_storage_error(ValueError(
        "OUT_OF_RANGE: Error writing local file \"x\": File too large [os_error_code='27']"))
