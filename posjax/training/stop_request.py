"""``StopRequest``: SIGTERM or Ctrl-C asks a training run to stop at the next step boundary,
with a checkpoint (single process; several processes use JAX's preemption sync point)."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import jax


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
