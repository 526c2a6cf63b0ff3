"""The GCE maintenance-event notice (Cloud TPU VMs) stops a run as a SIGTERM does.

A local metadata server on 127.0.0.1 (``GCE_METADATA_HOST``) answers
``/computeMetadata/v1/instance/maintenance-event``; each test flips its answer from NONE to
TERMINATE_ON_HOST_MAINTENANCE:

* the watcher sends this process one SIGTERM on the event, none on NONE, none for an answer
  that is not the metadata server's, none after it has ended, and survives a server that is
  not there (polling on until one answers);
* ``preemption`` config values: 'auto' polls nothing on CPU; a bad value is one error;
* one process: the event mid-run stops the run with a checkpoint of the step it reached,
  and the next run resumes from that step;
* two processes, only process 1's metadata server reporting the event: both save the same
  step and stop (JAX's preemption sync point).
"""
from __future__ import annotations

import http.server
import json
import logging
import os
import pathlib
import re
import signal
import socket
import threading
import time

import pytest

import test_multiprocess as mp
from jax_env import compilation_cache
from posjax import config_defaults
from posjax.training import run_config, stop_request, trainer
from posjax.training.checkpointing import integrity
from synthetic_runs import tiny_config

EVENT = "TERMINATE_ON_HOST_MAINTENANCE"


class MetadataServer:
    """A GCE metadata server on 127.0.0.1 that answers the maintenance event with ``event``
    (set it to flip the answer); ``requests`` counts the reads. ``flavor=False``: answers
    without the ``Metadata-Flavor: Google`` header (not the metadata server)."""

    def __init__(self, port: int = 0, event: str = "NONE", flavor: bool = True):
        self.event, self.flavor, self.requests = event, flavor, 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):   # noqa: N802 (http.server's name)
                right = (self.path == stop_request.MAINTENANCE_EVENT_PATH
                         and self.headers.get("Metadata-Flavor") == "Google")
                owner.requests += right
                body = owner.event.encode() if right else b"not found"
                self.send_response(200 if right else 404)
                if owner.flavor:
                    self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.host = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.url = f"http://{self.host}{stop_request.MAINTENANCE_EVENT_PATH}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = MetadataServer()
    yield s
    s.close()


@pytest.fixture
def sigterms():
    """SIGTERMs this process receives, counted (Python's handler: the main thread)."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGTERM, previous)


def _wait_for(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)    # the main thread runs Python signal handlers between bytecodes
    return predicate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_watcher_sends_one_sigterm_on_the_event_and_none_on_none(server, sigterms):
    with stop_request.MaintenanceWatcher(0.02, server.url) as watcher:
        assert _wait_for(lambda: server.requests >= 5)
        assert sigterms == [] and watcher.event is None
        server.event = EVENT
        assert _wait_for(lambda: sigterms)
        assert _wait_for(lambda: not watcher._thread.is_alive())   # done after one signal
        requests = server.requests
        time.sleep(0.2)
    assert sigterms == [signal.SIGTERM] and watcher.event == EVENT
    assert server.requests == requests


def test_a_dead_server_is_logged_once_and_polled_until_one_answers(sigterms, caplog):
    port = _free_port()    # nothing listens there yet
    caplog.set_level(logging.INFO)
    with stop_request.MaintenanceWatcher(
            0.02, f"http://127.0.0.1:{port}{stop_request.MAINTENANCE_EVENT_PATH}") as watcher:
        time.sleep(0.5)
        assert watcher._thread.is_alive() and sigterms == []
        unread = [r for r in caplog.records if "maintenance event: cannot read" in r.message]
        assert len(unread) == 1 and unread[0].levelno == logging.INFO, caplog.text
        late = MetadataServer(port, event=EVENT)
        try:
            assert _wait_for(lambda: sigterms)
        finally:
            late.close()
    assert sigterms == [signal.SIGTERM]
    assert len([r for r in caplog.records if "cannot read" in r.message]) == 1


def test_no_sigterm_from_a_server_without_the_metadata_flavor_nor_after_the_end(server,
                                                                              sigterms):
    server.flavor, server.event = False, EVENT    # a proxy's page, say
    with stop_request.MaintenanceWatcher(0.02, server.url) as watcher:
        assert _wait_for(lambda: server.requests >= 5)
    assert not watcher._thread.is_alive() and sigterms == [] and watcher.event is None
    server.flavor, server.event = True, "NONE"
    with stop_request.MaintenanceWatcher(0.02, server.url) as watcher:
        assert _wait_for(lambda: server.requests >= 7)
    assert not watcher._thread.is_alive()
    server.event = EVENT
    time.sleep(0.2)
    assert sigterms == []


def test_stop_request_polls_as_config_preemption_says(server, monkeypatch, terminal_signals):
    monkeypatch.setenv(stop_request.METADATA_HOST_ENV, server.host)
    assert stop_request.maintenance_event_url() == server.url
    for mode in ("auto", "off"):   # auto: only on TPU (these tests run on CPU)
        with stop_request.StopRequest({"poll_maintenance_event": mode,
                                       "poll_seconds": 0.02}) as stop:
            assert stop._watcher is None
    with stop_request.StopRequest({"poll_maintenance_event": "on", "poll_seconds": 0.02}) as stop:
        assert _wait_for(lambda: server.requests >= 2) and not stop.requested
        server.event = EVENT
        assert _wait_for(lambda: stop.requested)
    assert stop._watcher is None


@pytest.mark.parametrize("key,value,message", [
    ("poll_maintenance_event", "yes", "preemption.poll_maintenance_event='yes' is not valid: "
                                      "use 'auto' (poll the GCE maintenance event on TPU "
                                      "only), 'on' or 'off'"),
    ("poll_seconds", 0.0, "preemption.poll_seconds=0.0 is not valid: give the seconds between "
                          "two polls, a number > 0 (default 5)"),
    ("poll_seconds", float("inf"), "preemption.poll_seconds=inf is not valid"),
])
def test_a_bad_preemption_value_is_one_error_naming_the_field(key, value, message):
    config = config_defaults.default_config()
    run_config.validate_training_config(config)
    config.preemption[key] = value
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        run_config.validate_training_config(config)
    assert stop_request.maintenance_watcher(config.preemption) is None   # polls nothing
    config = config_defaults.default_config()
    config.preemption.poll_every = 5
    with pytest.raises(ValueError, match="unknown config key.*'preemption.poll_every'"):
        run_config.validate_training_config(config)


def _train_steps(workdir: pathlib.Path) -> list[int]:
    records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["split"] == "train"]


def test_the_event_mid_run_stops_with_a_checkpoint_and_the_rerun_resumes(
        tmp_path, server, monkeypatch, terminal_signals, caplog):
    monkeypatch.setenv(stop_request.METADATA_HOST_ENV, server.host)
    workdir = tmp_path / "run"
    config = tiny_config(**{"num_steps": 1000, "checkpoint.every_steps": 1000,
                            "preemption.poll_maintenance_event": "on",
                            "preemption.poll_seconds": 0.05})

    ended = threading.Event()

    def flip_at_step_3():
        while not ended.wait(0.02):
            if (workdir / "metrics.jsonl").exists() and max(_train_steps(workdir),
                                                             default=0) >= 3:
                server.event = EVENT
                return

    threading.Thread(target=flip_at_step_3, daemon=True).start()
    try:
        first = trainer.train(config, workdir)
    finally:
        ended.set()
    assert server.event == EVENT and server.requests >= 1
    assert first.preempted and 3 <= first.step < 1000, first
    assert integrity.saved_steps(workdir) == [first.step]    # the stop's save, nothing else
    assert f"maintenance event {EVENT} on this host" in caplog.text
    assert _train_steps(workdir) == list(range(1, first.step + 1))

    server.event = "NONE"      # the host came back; the setting may change on resume too
    config.preemption.poll_maintenance_event = "off"
    second = trainer.train(config, workdir, stop_after=first.step + 2)
    assert second.start == first.step and second.step == first.step + 2, second
    assert integrity.saved_steps(workdir) == [first.step, first.step + 2]
    assert _train_steps(workdir) == list(range(1, first.step + 3))   # each step once


# Each process's metadata server: $METADATA_HOST_<process id> becomes its GCE_METADATA_HOST.
METADATA_HOST_PER_PROCESS = """
import os, runpy, sys
i = [a for a in sys.argv if a.startswith("--config.distributed.process_id=")][0].split("=")[1]
os.environ["GCE_METADATA_HOST"] = os.environ["METADATA_HOST_" + i]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_event_on_one_host_stops_both_processes_at_the_same_step(tmp_path, monkeypatch):
    quiet, announcing = MetadataServer(), MetadataServer()
    monkeypatch.setenv("METADATA_HOST_0", quiet.host)
    monkeypatch.setenv("METADATA_HOST_1", announcing.host)
    monkeypatch.setattr(mp, "_JAX_CACHE", compilation_cache(tmp_path / "jax_cache"))
    num_steps = 60
    overrides = {**mp.OVERRIDES, "num_steps": num_steps, **mp.MULTI,
                 "preemption.poll_maintenance_event": "on", "preemption.poll_seconds": 0.05}
    workdir, logs = tmp_path / "w", [tmp_path / f"p{i}.log" for i in range(2)]
    procs, copiers = mp.start(workdir, logs, "configs/vit_digits.py:tiny",
                              [f"--config.{k}={v}" for k, v in overrides.items()],
                              python_args=("-c", METADATA_HOST_PER_PROCESS))
    try:
        try:
            while procs[0].poll() is None and f"step 2/{num_steps} " not in logs[0].read_text():
                time.sleep(0.05)
            announcing.event = EVENT
        except BaseException:
            mp.stop_all(procs, copiers)
            raise
        codes = mp.wait_all(procs, copiers, timeout_s=120)
    finally:
        quiet.close()
        announcing.close()
    outputs = [log.read_text() for log in logs]
    for output, code in zip(outputs, codes):
        assert code == 0, output[-3000:]
    stopped = [mp._stopped_step(output) for output in outputs]
    assert stopped[0] == stopped[1] and 2 < stopped[0] < num_steps, stopped
    assert quiet.requests >= 1 and announcing.requests >= 1
    assert f"maintenance event {EVENT}" in outputs[1] and "maintenance event" not in outputs[0]
    assert "SIGTERM caught" in outputs[1] and "SIGTERM caught" not in outputs[0]
    assert integrity.saved_steps(workdir) == [stopped[0]]
    files = sorted(p.name for p in (workdir / "checkpoints" / str(stopped[0]) / "data_iter"
                                    ).glob("process_*"))
    assert files == ["process_0-of-2.json", "process_1-of-2.json"]
