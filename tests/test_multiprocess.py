"""Real 2-process training with train.py (127.0.0.1 coordinator, 2 x 4 CPU devices, gloo
collectives, mesh data 2 x fsdp 2 x tensor 2) on the digits config, with dropout and mixup:

* preemption: SIGTERM to process 1 only, and later to both processes, makes both processes
  stop after the same step, save it (both iterator states) and exit 0; the next launch
  resumes from there, the last one finishes;
* the interrupted-and-resumed 2-process run equals the uninterrupted 1-process 8-device run
  (mesh data 8): loss at every step within 1e-5, the same eval and final parameters. This
  holds because the input pipeline's global batches do not depend on the process count;
* processes given different configs, or workdirs that are not one shared directory, both end
  with one error before anything is written.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import ml_collections
import numpy as np
import pytest

from jax_env import compilation_cache, xla_flags
from posjax.training import run_setup
from posjax.training import trainer
from posjax.training import workdir as workdir_lib
from posjax.training.checkpointing import checkpointer as ckpt_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUM_STEPS = 24
OVERRIDES = {"num_steps": NUM_STEPS, "log_every_steps": 1, "checkpoint.every_steps": 1000,
             "model.dropout_rate": 0.1, "data.mixup_alpha": 0.2,
             "peak_flops": 1e12}   # skips measuring the CPU's peak (seconds on a busy machine)
MULTI = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "distributed.enabled": True,
         "distributed.num_processes": 2}


def digits_tiny(**overrides) -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location("vit_digits", ROOT / "configs" / "vit_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    config.update_from_flattened_dict(overrides)
    return config


_JAX_CACHE: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def jax_compilation_cache(tmp_path_factory) -> None:
    """The launches of this module share JAX's persistent compilation cache: the preempted
    run's second and third launches and the eval do not compile its programs again."""
    _JAX_CACHE.update(compilation_cache(tmp_path_factory.mktemp("jax_cache")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(workdir: pathlib.Path, logs: list[pathlib.Path], config: str, flags: list[str],
          extra_flags: dict[int, list[str]] | None = None, python_args: tuple[str, ...] = (),
          script: str = "train.py") -> tuple[list, list]:
    """Start ``script`` as process i of 2 (127.0.0.1 coordinator) with ``flags`` plus
    ``extra_flags[i]``, its output copied line by line into ``logs[i]``. Returns the processes
    and their copier threads (end them with ``wait_all`` or ``stop_all``)."""
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "PYTHONFAULTHANDLER": "1", "XLA_FLAGS": xla_flags(4), **_JAX_CACHE}
    procs, copiers = [], []
    for i, log in enumerate(logs):
        procs.append(subprocess.Popen(
            [sys.executable, *python_args, script, "--config", config, *flags,
             f"--config.distributed.coordinator_address=127.0.0.1:{port}",
             f"--config.distributed.process_id={i}", f"--workdir={workdir}",
             *(extra_flags or {}).get(i, [])],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        # This process writes the log (a child's file-size cap must not cut it short). The
        # file exists before the caller polls it.
        copiers.append(threading.Thread(target=_copy_lines,
                                        args=(procs[-1].stdout, log.open("wb"))))
        copiers[-1].start()
    return procs, copiers


def stop_all(procs: list, copiers: list) -> None:
    """Kill the processes still running, reap them all and let their copiers finish."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for copier in copiers:
        copier.join(timeout=60)


def wait_all(procs: list, copiers: list, timeout_s: float = 300) -> list[int]:
    """Exit statuses of ``procs`` (each given ``timeout_s``); then ``stop_all``."""
    try:
        return [p.wait(timeout=timeout_s) for p in procs]
    finally:
        stop_all(procs, copiers)


def launch(workdir: pathlib.Path, log_dir: pathlib.Path, name: str,
           sigterm_to: tuple[int, ...] = (), after_step: int = 0,
           extra_flags: dict[int, list[str]] | None = None,
           config: str = "configs/vit_digits.py:tiny",
           overrides: dict | None = None,
           python_args: tuple[str, ...] = (),
           script: str = "train.py") -> list[tuple[str, int]]:
    """Run ``script`` (train.py) on ``config`` with ``overrides`` (default OVERRIDES) as 2
    processes (``extra_flags``: more flags for some of them; ``python_args``: before it);
    with ``sigterm_to``, send SIGTERM to those processes once process 0 reports
    ``after_step``. Returns [(output, exit status)] per process."""
    flags = [f"--config.{k}={v}" for k, v in {**(overrides or OVERRIDES), **MULTI}.items()]
    logs = [log_dir / f"{name}_{i}.log" for i in range(2)]
    procs, copiers = start(workdir, logs, config, flags, extra_flags, python_args, script)
    try:
        if sigterm_to:
            trigger = f"step {after_step}/{NUM_STEPS} "
            while procs[0].poll() is None and trigger not in logs[0].read_text():
                time.sleep(0.05)
            for i in sigterm_to:
                procs[i].send_signal(signal.SIGTERM)
    except BaseException:
        stop_all(procs, copiers)
        raise
    codes = wait_all(procs, copiers)
    return [(log.read_text(), code) for log, code in zip(logs, codes)]


def _copy_lines(stream, out) -> None:
    """Copy a child's output into the open file ``out`` line by line, flushed (polled by
    ``launch``); closes both."""
    with stream, out:
        for line in stream:
            out.write(line)
            out.flush()


def _tail(output: str) -> str:
    """What a failed assertion shows of a child's output: its end, or from a native crash's
    "Fatal Python error" on (its threads' stacks come before the long extension-module list
    that would fill the end)."""
    crash = output.find("Fatal Python error")
    return output[crash:crash + 8000] if crash >= 0 else output[-3000:]


def _stopped_step(output: str) -> int:
    assert "preempted: checkpoint saved at step " in output, _tail(output)
    return int(output.split("preempted: checkpoint saved at step ")[1].split(";")[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-process run, preempted twice: SIGTERM to process 1 once process 0 has finished
    step 2 (meanwhile this process makes the 1-process run); a second launch resumes and gets
    SIGTERM in BOTH processes two steps after its start; a third resumes to the end."""
    root = tmp_path_factory.mktemp("multiprocess")
    single, multi = root / "single", root / "multi"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(launch, multi, root, "first", sigterm_to=(1,), after_step=2)
        trainer.train(digits_tiny(**OVERRIDES), single)
        first = first.result()
    resumed_at = _stopped_step(first[0][0])
    assert resumed_at + 2 < NUM_STEPS - 1, "the first preemption came too late to test a second"
    second = launch(multi, root, "second", sigterm_to=(0, 1), after_step=resumed_at + 2)
    third = launch(multi, root, "third")
    return single, multi, first, second, third


def _train_losses(workdir: pathlib.Path) -> dict[int, float]:
    records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in records if r["split"] == "train"]
    assert len(losses) == len(dict(losses)), "a step was logged twice"
    return dict(losses)


def test_sigterm_to_one_process_stops_both_at_the_same_step(runs):
    _, multi, first, second, _ = runs
    stopped = _stopped_step(first[0][0])
    for output, code in first:
        assert code == 0, _tail(output)
        assert _stopped_step(output) == stopped           # both processes, the same step
    assert 2 < stopped < NUM_STEPS
    assert "SIGTERM caught" in first[1][0] and "SIGTERM caught" not in first[0][0]
    files = sorted(p.name for p in (multi / "checkpoints" / str(stopped) / "data_iter"
                                    ).glob("process_*"))
    assert files == ["process_0-of-2.json", "process_1-of-2.json"]
    evals = [p.name for p in (multi / "checkpoints").glob("eval_*.json")]
    assert evals == [f"eval_{NUM_STEPS}_test.json"]     # none at the preempted step
    assert f"resuming from {multi / 'checkpoints' / str(stopped)}" in second[0][0]


def test_sigterm_to_both_processes_stops_both_at_the_same_step(runs):
    _, multi, first, second, third = runs
    first_stop, stopped = _stopped_step(first[0][0]), _stopped_step(second[0][0])
    for output, code in second:
        assert code == 0, _tail(output)
        assert _stopped_step(output) == stopped
    assert first_stop + 2 <= stopped < NUM_STEPS
    for output, code in third:
        assert code == 0 and "preempted" not in output, _tail(output)
    assert f"resuming from {multi / 'checkpoints' / str(stopped)}" in third[0][0]
    assert f"final eval at step {NUM_STEPS}" in third[0][0]


def test_two_processes_equal_one_process(runs):
    single, multi, *_ = runs
    losses_multi, losses_single = _train_losses(multi), _train_losses(single)
    assert sorted(losses_multi) == sorted(losses_single) == list(range(1, NUM_STEPS + 1))
    for step, loss in losses_single.items():
        assert abs(losses_multi[step] - loss) <= 1e-5, (step, losses_multi[step], loss)
    eval_multi = json.loads(workdir_lib.eval_file(multi, NUM_STEPS, "test").read_text())
    eval_single = json.loads(workdir_lib.eval_file(single, NUM_STEPS, "test").read_text())
    assert eval_multi["num_examples"] == eval_single["num_examples"] == 359
    assert abs(eval_multi["accuracy"] - eval_single["accuracy"]) <= 1 / 359
    config = digits_tiny(**OVERRIDES)
    params = []
    for workdir in (multi, single):
        run = run_setup.prepare(config, workdir, training=False)
        checkpointer = ckpt_lib.Checkpointer(workdir, 1, 0, create=False)
        params.append(checkpointer.restore(NUM_STEPS, run.abstract).params)
        checkpointer.close()
    for x, y in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1])):
        # Adam moves a parameter by ~lr·sign(g) when g ≈ 0, so allow a little more than 1e-5.
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=5e-4)


LISTING_WITHOUT_THE_LATEST_STEP = """
import runpy, sys
from posjax.training import run_setup
from posjax.training import trainer
from posjax.training.checkpointing import integrity
if "--config.distributed.process_id=1" in sys.argv:
    listed = integrity.saved_steps
    integrity.saved_steps = lambda workdir: listed(workdir)[:-1]   # its listing lags a save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_eval_processes_evaluate_the_step_process_0_chose(runs):
    """eval.py, 2 processes, beside a run that has just saved: process 1 does not list the
    latest step yet. Both evaluate process 0's latest step, and the result is the run's own
    final eval (before, process 1 restored an older step into the same global state)."""
    _, multi, _, _, _ = runs
    path = workdir_lib.eval_file(multi, NUM_STEPS, "test")
    trained = json.loads(path.read_text())
    path.unlink()
    results = launch(multi, multi.parent, "eval", config=f"configs/saved.py:{multi}",
                     overrides={"peak_flops": 1e12}, script="eval.py",
                     python_args=("-c", LISTING_WITHOUT_THE_LATEST_STEP))
    for output, code in results:
        assert code == 0, _tail(output)
        assert f'"step": {NUM_STEPS},' in output, _tail(output)
    assert f"process 1: evaluating step {NUM_STEPS}, process 0's choice" in results[1][0]
    evaluated = json.loads(path.read_text())
    assert evaluated["num_examples"] == trained["num_examples"] == 359
    assert evaluated["accuracy"] == pytest.approx(trained["accuracy"], abs=1e-6)


def test_eval_refuses_a_workdir_the_processes_do_not_share(runs, tmp_path):
    """eval.py with process 1 on an empty directory of its own (as a path on each host's own
    disk would be): both processes end with the same error, not process 1 alone with 'no
    checkpoints' (its view) while process 0 waits for it in a collective."""
    _, multi, _, _, _ = runs
    results = launch(multi, tmp_path, "eval_unshared", config=f"configs/saved.py:{multi}",
                     overrides={"peak_flops": 1e12}, script="eval.py",
                     extra_flags={1: [f"--workdir={tmp_path / 'empty'}"]})
    for i, (out, code) in enumerate(results):
        workdir = multi if i == 0 else tmp_path / "empty"
        assert code == 1 if i == 0 else code != 0, out[-3000:]
        assert f"process {i}: error: workdir {str(workdir)!r} is not one directory shared by " \
            "every process: process 1 does not see the config.json that process 0 sees " \
            "there" in out, out[-3000:]


def test_eval_processes_agree_on_init_from_weights_and_evaluate_them(runs, tmp_path):
    """eval.py, 2 processes, on the finished 2-process run's weights as init_from in a fresh
    workdir: both read the same checkpoint (fingerprints agree) and give the run's own final
    eval, as step 0."""
    _, multi, _, _, _ = runs
    trained = json.loads(workdir_lib.eval_file(multi, NUM_STEPS, "test").read_text())
    results = launch(tmp_path / "eval", tmp_path, "eval_init_from",
                     config=f"configs/saved.py:{multi}", script="eval.py",
                     overrides={"peak_flops": 1e12, "init_from": str(multi)})
    for output, code in results:
        assert code == 0, _tail(output)
    evaluated = json.loads(workdir_lib.eval_file(tmp_path / "eval", 0, "test").read_text())
    assert evaluated["accuracy"] == pytest.approx(trained["accuracy"], abs=1e-6)


def test_a_failure_in_one_process_ends_both_promptly(tmp_path):
    """Process 1 alone fails (its --workdir cannot be created): it prints the error and ends at
    once, without JAX's shutdown barrier (which would hold it for minutes); process 0, waiting
    for it in a collective, then fails too instead of hanging."""
    start = time.monotonic()
    (out0, code0), (out1, code1) = launch(tmp_path / "w", tmp_path, "fail",
                                          extra_flags={1: ["--workdir=/proc/posjax-w"]})
    assert code1 == 1 and "process 1: error: " in out1 and "/proc/posjax-w" in out1, out1
    assert code0 == 1 and "process 0: " in out0, out0[-2000:]
    assert time.monotonic() - start < 150


def test_processes_started_with_different_configs_both_refuse_it(tmp_path):
    """Process 1 alone is given another (valid) learning rate: both processes print one error
    naming the key and both values, before anything is compiled or written."""
    rate = digits_tiny(**OVERRIDES).optimizer.learning_rate
    results = launch(tmp_path / "w", tmp_path, "configs",
                     extra_flags={1: [f"--config.optimizer.learning_rate={rate * 2}"]})
    for i, (out, code) in enumerate(results):
        # Process 0 exits 1; JAX's coordination service may then abort process 1 in its grace.
        assert code == 1 if i == 0 else code != 0, out[-3000:]
        assert f"process {i}: error: the processes were started with different configs:\n" \
            f"  process 1: optimizer.learning_rate={rate * 2!r} (process 0: {rate!r})\n" \
            "Start every process with the same --config" in out, out[-3000:]
    assert not (tmp_path / "w").exists()


def test_a_workdir_the_processes_do_not_share_is_refused_before_it_is_written(tmp_path):
    """Process 1 is given another --workdir (as a path on each host's own disk would be): it
    does not see the file process 0 writes to check, and both processes end with one error
    before the run's config is written."""
    workdirs = [tmp_path / "w", tmp_path / "w1"]
    results = launch(workdirs[0], tmp_path, "unshared",
                     extra_flags={1: [f"--workdir={workdirs[1]}"]})
    for i, (out, code) in enumerate(results):
        assert code == 1 if i == 0 else code != 0, out[-3000:]
        assert f"process {i}: error: workdir {str(workdirs[i])!r} is not one directory shared " \
            "by every process: process 1 does not see a file that process 0 wrote there" \
            in out, out[-3000:]
    assert [sorted(p.name for p in w.iterdir()) for w in workdirs] == [[], []]


def test_a_failed_background_save_stops_both_processes_before_the_next_save(tmp_path):
    """Files capped at 8 KiB in both processes: step 50's save fails in the background. The
    processes agree at a log step (one all-gather of "my save has ended") and both stop with
    the error naming step 50, before the final save at step 100 (where, before, they first
    noticed)."""
    from test_train_cli import FILES_CAPPED
    overrides = {**OVERRIDES, "num_steps": 100, "log_every_steps": 5,
                 "checkpoint.every_steps": 50}
    results = launch(tmp_path / "w", tmp_path, "capped", overrides=overrides,
                     python_args=("-c", FILES_CAPPED))
    for i, (out, code) in enumerate(results):
        # Both print the error (process 1 waits run_command's grace for process 0 to print
        # its own); process 0 exits 1, then JAX's coordination service aborts process 1.
        assert code == 1 if i == 0 else code != 0, out[-3000:]
        assert f"process {i}: error: the checkpoint of step 50 could not be written in " \
            f"{tmp_path / 'w' / 'checkpoints'} (" in out, out[-3000:]
        assert "step 100/100 " not in out, out[-3000:]


TEXT_OVERRIDES = {"num_steps": 4, "log_every_steps": 1, "eval_every_steps": 1000,
                  "checkpoint.every_steps": 1000, "optimizer.warmup_steps": 0,
                  "model.num_layers": 1, "model.hidden_size": 64, "model.num_heads": 2,
                  "model.mlp_dim": 128, "peak_flops": 1e12}


def test_text_model_two_processes_equal_one_process(tmp_path, shared_data):
    """MLM BERT-A with dropout on data 2 × fsdp 2 × tensor 2: the word-embedding lookup from the
    fsdp- and tensor-split table, across 2 processes, gives the losses of 1 process."""
    from configs.text_recipes import mlm_config
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        multi = pool.submit(launch, tmp_path / "multi", tmp_path, "text",
                            config="configs/mlm_bert_a.py:tiny", overrides=TEXT_OVERRIDES)
        config = mlm_config("bert_a", "tiny")
        config.update_from_flattened_dict({**TEXT_OVERRIDES, "mesh.data": 2, "mesh.fsdp": 2,
                                           "mesh.tensor": 2})
        trainer.train(config, tmp_path / "single")
        outputs = multi.result()
    for output, code in outputs:
        assert code == 0, _tail(output)
        assert "Involuntary full rematerialization" not in output
    losses_multi, losses_single = (_train_losses(tmp_path / w) for w in ("multi", "single"))
    assert sorted(losses_multi) == sorted(losses_single) == [1, 2, 3, 4]
    for step, loss in losses_single.items():
        assert abs(losses_multi[step] - loss) <= 1e-5, (step, losses_multi[step], loss)
