"""A process of a 2-process run (127.0.0.1 coordinator, gloo, as tests/test_multiprocess.py)
that dies or hangs never leaves the other one waiting: killed (SIGKILL) mid-training, mid-save,
or stopped (SIGSTOP: a hung host, its connections open), the survivor exits non-zero within
``distributed.peer_timeout_s`` (JAX's heartbeat timeout) with a message that a peer was lost.
Both started again resume from the last checkpoint and end as an uninterrupted run does.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import signal
import time

import pytest

from jax_env import compilation_cache
from posjax.training import trainer

import test_multiprocess as mp

NUM_STEPS = 24
PEER_TIMEOUT_S = 10   # small, yet no false alarm on a loaded 2-core machine
OVERRIDES = {**mp.OVERRIDES, "checkpoint.every_steps": 4, "num_steps": NUM_STEPS}
SURVIVOR_LIMIT_S = PEER_TIMEOUT_S + 30   # the timeout, plus the abort and its stack dump

_JAX_CACHE: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def jax_compilation_cache(tmp_path_factory) -> None:
    _JAX_CACHE.update(compilation_cache(tmp_path_factory.mktemp("jax_cache")))


def _start(workdir: pathlib.Path, logs: list[pathlib.Path],
           peer_timeout_s: int = PEER_TIMEOUT_S) -> tuple[list, list]:
    flags = [f"--config.{k}={v}" for k, v in {**OVERRIDES, **mp.MULTI}.items()]
    return mp.start(workdir, logs, "configs/vit_digits.py:tiny",
                    [*flags, f"--config.distributed.peer_timeout_s={peer_timeout_s}"])


def _partial_saves(checkpoints: pathlib.Path) -> set[str]:
    """Names of the partial (in progress or abandoned) saves in ``checkpoints``."""
    try:
        return {n for n in os.listdir(checkpoints) if ".orbax-checkpoint-tmp" in n}
    except FileNotFoundError:
        return set()


def launch_and_hit(workdir, log_dir, name, victim, sig, after_step=None, mid_save=False):
    """Start the 2 processes; once process 0 reports ``after_step`` (or, ``mid_save``, as soon
    as a save is in progress: a partial step directory exists), send ``sig`` to ``victim``.
    Returns (survivor's output, its exit status, seconds from the signal to its exit, whether
    the signal came during a save)."""
    logs = [log_dir / f"{name}_{i}.log" for i in range(2)]
    checkpoints = workdir / "checkpoints"
    # A partial save left by an earlier hit is no sign of a save now: seen at once, it would
    # have the victim killed before it joined the run (the survivor then waits JAX's 300 s
    # for it to connect).
    partial_before = _partial_saves(checkpoints)
    procs, copiers = _start(workdir, logs)
    survivor = procs[1 - victim]
    during_save = False
    try:
        while procs[0].poll() is None:
            if mid_save:
                if _partial_saves(checkpoints) - partial_before:
                    during_save = True
                    break
                time.sleep(0.001)
            else:
                if f"step {after_step}/{NUM_STEPS} " in logs[0].read_text():
                    break
                time.sleep(0.05)
        hit = time.monotonic()
        procs[victim].send_signal(sig)
        code = survivor.wait(timeout=300)
        took = time.monotonic() - hit
    finally:
        mp.stop_all(procs, copiers)
    return logs[1 - victim].read_text(), code, took, during_save


def finish(workdir, log_dir, name):
    logs = [log_dir / f"{name}_{i}.log" for i in range(2)]
    codes = mp.wait_all(*_start(workdir, logs, peer_timeout_s=120))   # the default timeout
    return [(log.read_text(), code) for log, code in zip(logs, codes)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-process run hit three times (kill -9 of process 1 after step 9, SIGSTOP of
    process 0 after the next resume's first steps, kill -9 of process 1 during a save), then
    finished; and the same run uninterrupted, in this process (1 process, 8 devices)."""
    root = tmp_path_factory.mktemp("dead_host")
    multi, single = root / "multi", root / "single"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        killed = pool.submit(launch_and_hit, multi, root, "killed", 1, signal.SIGKILL, 9)
        trainer.train(mp.digits_tiny(**OVERRIDES), single)
        killed = killed.result()
    hung = launch_and_hit(multi, root, "hung", 0, signal.SIGSTOP, 14)
    mid_save = launch_and_hit(multi, root, "mid_save", 1, signal.SIGKILL, mid_save=True)
    finished = finish(multi, root, "finished")
    return single, multi, killed, hung, mid_save, finished


def test_a_killed_process_ends_its_peer_at_once_with_a_clear_message(runs):
    output, code, took, _ = runs[2]
    assert code != 0, output[-3000:]
    assert took < SURVIVOR_LIMIT_S, (took, output[-3000:])
    # Ours, when its collective fails first; JAX's, when the coordination service ends it.
    assert ("error: a peer process was lost (" in output
            or "another task died" in output), output[-3000:]
    print(f"survivor of a SIGKILLed peer exited {code} after {took:.1f} s")


def test_a_hung_process_ends_its_peer_within_the_peer_timeout(runs):
    output, code, took, _ = runs[3]
    assert code != 0, output[-3000:]
    assert took < SURVIVOR_LIMIT_S, (took, output[-3000:])
    assert "another task died" in output, output[-3000:]
    print(f"survivor of a SIGSTOPped peer (coordinator) exited {code} after {took:.1f} s")


def test_a_process_killed_during_a_save_ends_its_peer(runs):
    output, code, took, during_save = runs[4]
    assert during_save, "the kill came outside a save"
    assert code != 0 and took < SURVIVOR_LIMIT_S, (took, output[-3000:])
    print(f"survivor of a peer SIGKILLed mid-save exited {code} after {took:.1f} s")


def test_restarted_processes_resume_and_end_as_an_uninterrupted_run(runs):
    single, multi, *_, finished = runs
    for output, code in finished:
        assert code == 0, output[-3000:]
    assert "resuming from " in finished[0][0]
    assert f"final eval at step {NUM_STEPS}" in finished[0][0]
    assert not [p for p in (multi / "checkpoints").iterdir() if "orbax-checkpoint-tmp" in p.name]
    losses_multi, losses_single = mp._train_losses(multi), mp._train_losses(single)
    assert sorted(losses_multi) == sorted(losses_single) == list(range(1, NUM_STEPS + 1))
    for step, loss in losses_single.items():
        assert abs(losses_multi[step] - loss) <= 1e-5, (step, losses_multi[step], loss)
    evals = [json.loads((w / "checkpoints" / f"eval_{NUM_STEPS}_test.json").read_text())
             for w in (multi, single)]
    assert abs(evals[0]["accuracy"] - evals[1]["accuracy"]) <= 1 / 359
