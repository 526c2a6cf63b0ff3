"""``StopRequest``: SIGTERM or Ctrl-C asks a training run to stop at the next step boundary,
with a checkpoint (single process; several processes use JAX's preemption sync point).
``MaintenanceWatcher``: a GCE host's advance notice of maintenance (the metadata server's
``maintenance-event``, as on Cloud TPU VMs) becomes a SIGTERM to this process, which then
stops the run the same way."""
from __future__ import annotations

import http.client
import logging
import math
import os
import signal
import sys
import threading
import urllib.request
from typing import Any, Mapping

import jax

METADATA_HOST_ENV = "GCE_METADATA_HOST"   # host:port, as Google's client libraries read it
METADATA_HOST = "metadata.google.internal"
MAINTENANCE_EVENT_PATH = "/computeMetadata/v1/instance/maintenance-event"
POLL_MODES = ("auto", "on", "off")   # auto: poll when the JAX backend is TPU
HTTP_TIMEOUT_S = 2.0


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
    sees every press at once.

    ``preemption`` (``config.preemption``) may also start a ``MaintenanceWatcher``, with one
    process or several: its SIGTERM reaches this handler or JAX's preemption notifier. None
    starts where nothing would stop the run on it (another thread, SIGTERM ignored); without
    ``preemption`` (None) nothing polls."""

    def __init__(self, preemption: Mapping[str, Any] | None = None):
        self.requested = False
        self._preemption = preemption
        self._watcher: MaintenanceWatcher | None = None
        self._in_steps = False
        self._lock = threading.Lock()
        self._previous: dict[int, Any] = {}
        self._previous_fd: int | None = None
        self._pipe: tuple[int, int] | None = None

    def __enter__(self) -> "StopRequest":
        several = jax.process_count() > 1
        if not several and threading.current_thread() is threading.main_thread():
            self._install()
        # A SIGTERM needs a receiver that stops the run: JAX's notifier, or this handler.
        if several or signal.SIGTERM in self._previous:
            self._watcher = maintenance_watcher(self._preemption)
            if self._watcher is not None:
                self._watcher.__enter__()
        return self

    def _install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(signum) != signal.SIG_IGN:
                self._previous[signum] = signal.signal(signum, self._request)
        self._pipe = os.pipe()
        os.set_blocking(self._pipe[1], False)
        self._previous_fd = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(self._pipe[0],), name="stop-request",
                         daemon=True).start()

    def __exit__(self, *exc: Any) -> None:
        if self._watcher is not None:   # first: no SIGTERM from it once the handlers are gone
            self._watcher.__exit__(*exc)
            self._watcher = None
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


def validate(preemption: Mapping[str, Any]) -> None:
    """``config.preemption``: a bad value is one ValueError naming the field and the fix."""
    mode = preemption.get("poll_maintenance_event", "auto")
    if not isinstance(mode, str) or mode not in POLL_MODES:
        raise ValueError(f"preemption.poll_maintenance_event={mode!r} is not valid: use 'auto' "
                         "(poll the GCE maintenance event on TPU only), 'on' or 'off'")
    seconds = preemption.get("poll_seconds", 5)
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
            or not 0 < seconds < math.inf):
        raise ValueError(f"preemption.poll_seconds={seconds!r} is not valid: give the seconds "
                         "between two polls, a number > 0 (default 5)")


def maintenance_watcher(preemption: Mapping[str, Any] | None) -> MaintenanceWatcher | None:
    """The watcher ``preemption`` asks for; None when it asks for none ('off', 'auto' off
    TPU) or holds a bad value (``run_config`` validates the config and names it)."""
    if preemption is None:
        return None
    try:
        validate(preemption)
    except ValueError:
        return None
    mode = preemption.get("poll_maintenance_event", "auto")
    if mode == "off" or (mode == "auto" and jax.default_backend() != "tpu"):
        return None
    return MaintenanceWatcher(float(preemption.get("poll_seconds", 5)))


def maintenance_event_url() -> str:
    """The metadata server's maintenance-event address (``$GCE_METADATA_HOST`` when set)."""
    host = os.environ.get(METADATA_HOST_ENV) or METADATA_HOST
    return f"http://{host}{MAINTENANCE_EVENT_PATH}"


def read_maintenance_event(url: str, timeout_s: float = HTTP_TIMEOUT_S) -> str:
    """The event the server reports ('NONE' when none). OSError when it cannot be read;
    ValueError for an answer without ``Metadata-Flavor: Google`` (not the metadata server: a
    proxy's or captive portal's page must not stop a run). No proxy is ever used."""
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout_s) as response:
        if response.headers.get("Metadata-Flavor") != "Google":
            raise ValueError("the answer lacks the header Metadata-Flavor: Google")
        return response.read(256).decode("ascii", "replace").strip()


class MaintenanceWatcher:
    """Context: a daemon thread reads the maintenance event every ``poll_seconds``. The first
    value other than 'NONE' is logged as one warning and sent as SIGTERM to this process;
    then the thread ends. After ``__exit__`` it sends nothing.

    A server it cannot read (off GCE, a timeout, an HTTP error) is logged once at INFO and
    polled on quietly, never given up: the metadata server of a GCE host can be out of reach
    for a moment too (around the very maintenance it announces), and giving up would lose the
    notice for the rest of a run of days; a failed read costs one request per poll."""

    def __init__(self, poll_seconds: float, url: str | None = None):
        self.poll_seconds = poll_seconds
        self.url = url or maintenance_event_url()
        self.event: str | None = None    # the event that was signalled
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, name="maintenance-event",
                                        daemon=True)

    def __enter__(self) -> "MaintenanceWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._ended.set()
        self._thread.join(timeout=HTTP_TIMEOUT_S)   # a read under way ends on its own

    def _poll(self) -> None:
        failed = False
        while not self._ended.is_set():
            try:
                event = read_maintenance_event(self.url)
            except (OSError, ValueError, http.client.HTTPException) as e:
                if not failed:
                    logging.info("maintenance event: cannot read %s (%s); polling on every %g s",
                                 self.url, e, self.poll_seconds)
                failed = True
            else:
                if event != "NONE":
                    with self._lock:
                        if not self._ended.is_set():
                            self.event = event
                            logging.warning("maintenance event %s on this host: SIGTERM, to "
                                            "stop after the current step with a checkpoint",
                                            event)
                            os.kill(os.getpid(), signal.SIGTERM)
                    return
            self._ended.wait(self.poll_seconds)
