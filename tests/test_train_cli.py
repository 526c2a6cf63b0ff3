"""train.py / eval.py as a user runs them: bad input exits non-zero with one message before
anything is written; SIGTERM saves and exits 0; rerunning resumes; eval.py reproduces the final
eval from the checkpoint train.py wrote."""
from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jax_env import compilation_cache, xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/vit_digits.py:tiny"]


_JAX_CACHE: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def jax_compilation_cache(tmp_path_factory) -> None:
    """The processes of this module share JAX's persistent compilation cache: the tiny run's
    init, train and eval steps compile once, not in each of ~30 processes (~7 s each)."""
    _JAX_CACHE.update(compilation_cache(tmp_path_factory.mktemp("jax_cache")))


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(),
            "PYTHONUNBUFFERED": "1", **_JAX_CACHE}


def _run(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_bad_input_exits_with_one_message(tmp_path):
    workdir = tmp_path / "w"
    unknown = _run("train.py", *TINY, "--config.optimizer.lr=3", f"--workdir={workdir}")
    assert unknown.returncode == 1
    assert unknown.stderr.strip().splitlines()[-1].startswith(
        "error: unknown config key 'optimizer.lr' in ")
    assert "Traceback" not in unknown.stderr
    typo = _run("train.py", *TINY, "--config.optimizer.learnig_rate=3", f"--workdir={workdir}")
    assert typo.returncode == 1 and "Traceback" not in typo.stderr
    assert typo.stderr.strip().splitlines()[-1].startswith(
        "error: unknown config key 'optimizer.learnig_rate' in ")
    assert typo.stderr.strip().endswith(
        'no such field (Did you mean "learning_rate" instead of "learnig_rate"?)')
    saved = tmp_path / "config.json"                 # a run's config.json given as a config
    saved.write_text('{"seed": 0, "async": false}')
    json_file = _run("train.py", "--config", str(saved), f"--workdir={workdir}")
    assert json_file.returncode == 1 and "Traceback" not in json_file.stderr
    assert json_file.stderr.strip().splitlines() == [
        f"error: cannot load the config given by --config {saved}: NameError: name 'false' is "
        "not defined; a run's config.json is loaded with --config configs/saved.py:WORKDIR"]
    mesh = _run("train.py", *TINY, "--config.mesh.data=2", f"--workdir={workdir}")
    assert mesh.returncode == 1 and "Traceback" not in mesh.stderr
    assert "error: mesh (data=2, fsdp=1, tensor=1) needs 2 devices but 1 are present" \
        in mesh.stderr
    variant = _run("train.py", "--config", "configs/vit_digits.py:bogus", f"--workdir={workdir}")
    assert variant.returncode == 1 and "Traceback" not in variant.stderr
    assert variant.stderr.strip().splitlines() == [
        "error: cannot load the config given by --config configs/vit_digits.py:bogus: variant "
        "'bogus' is unknown: use '' (default) or 'tiny'"]
    no_workdir = _run("train.py", *TINY)     # would mix its checkpoints into the default run's
    assert no_workdir.returncode == 1 and no_workdir.stderr.strip().splitlines() == [
        "error: --config needs a --workdir of its own (the default /tmp/posjax_digits is the "
        "default config's)"]
    for script in ("train.py", "eval.py"):   # --workdir=$UNSET would pick the default's
        empty = _run(script, "--workdir=")
        assert empty.returncode == 1 and empty.stderr.strip().splitlines() == [
            "error: --workdir is empty (an unset shell variable?): give the run's directory"]
    assert not workdir.exists()


def test_a_bucket_url_is_refused_before_anything_is_written(tmp_path):
    """pathlib made ``gs://b/x`` a local folder ``gs:/b/x``. The converter's --from takes no
    URL: one error. init_from and --to take a bucket, and without credentials (no emulator,
    key file, gcloud login or metadata server) refuse it with one error naming the fix. In
    every case nothing is created (``--workdir gs://...``: tests/test_gcs_workdir.py)."""
    url = "gs://bucket/run"
    advice = ("is a URL, but posjax opens its folders through the file system (a workdir needs "
              "file locks and atomic renames): give a local path, or on several hosts a shared "
              "file system every host mounts (NFS, Filestore)")
    env = {k: v for k, v in _env().items() if k not in (
        "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
        "GOOGLE_APPLICATION_CREDENTIALS")}
    env.update(PYTHONPATH=str(ROOT), CLOUDSDK_CONFIG="/nonexistent/gcloud",
               GCE_METADATA_HOST="127.0.0.1:9", GCE_METADATA_IP="127.0.0.1:9")
    tiny = ["--config", f"{ROOT / 'configs' / 'vit_digits.py'}:tiny"]
    no_credentials = "no Google Cloud credentials found"
    runs = {   # run from tmp_path, where nothing may appear
        f"error: init_from {url}: {no_credentials}": [
            sys.executable, str(ROOT / "train.py"), *tiny, "--workdir=run",
            f"--config.init_from={url}"],
        f"error: --to {url}: {no_credentials}": [
            sys.executable, "-m", "posjax.convert", "--from", str(tmp_path), "--to", url],
        f"error: --from='{url}' {advice}": [
            sys.executable, "-m", "posjax.convert", "--from", url, "--to", "out"],
    }
    for expected, command in runs.items():
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode in (1, 2) and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(expected), done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_sigterm_saves_resume_finishes_and_eval_reproduces(tmp_path):
    workdir = tmp_path / "run"
    args = ["train.py", *TINY, "--config.num_steps=200", "--config.log_every_steps=10",
            "--config.checkpoint.every_steps=100000", f"--workdir={workdir}"]
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 10/200"):
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "preempted: checkpoint saved at step" in out, out[-3000:]
    stopped = int(out.split("preempted: checkpoint saved at step ")[1].split(";")[0])
    assert 10 <= stopped < 200
    assert (workdir / "checkpoints" / str(stopped)).is_dir()
    assert not list((workdir / "checkpoints").glob("eval_*.json"))

    resumed = _run(*args)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"step {stopped}/200" not in resumed.stdout    # started after the saved step
    assert "final eval at step 200" in resumed.stdout
    records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if r["split"] == "train"]
    assert train_steps == list(range(10, 201, 10))         # each logged step exactly once
    written = json.loads((workdir / "checkpoints" / "eval_200_test.json").read_text())
    assert written["num_examples"] == 359

    evaluated = _run("eval.py", f"--workdir={workdir}")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.loads(evaluated.stdout) == written
    assert json.loads((workdir / "checkpoints" / "eval_200_test.json").read_text()) == written

    # --config.* overrides apply to the saved config: how the data is read may change ...
    overridden = _run("eval.py", f"--workdir={workdir}", "--config.mesh.fsdp=1",
                      "--config.eval_batch_size=8", "--config.data.test_split=test[:100]")
    assert overridden.returncode == 0, overridden.stderr[-2000:]
    assert json.loads(overridden.stdout)["num_examples"] == 100
    # ... the model may not: one message naming the field, before any restore.
    refused = _run("eval.py", f"--workdir={workdir}", "--config.model.hidden_size=32")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith(f"error: the config differs from the run's "
                                     f"{workdir / 'config.json'} in keys that define the model")
    assert "\n  model.hidden_size: 16 -> 32\n" in refused.stderr


SIGTERM_DURING_SETUP = """
import os, signal, sys, time
from posjax import cli
from posjax.training import evaluator
from posjax.training import run_setup
from posjax.training import state as state_lib
from posjax.training import trainer
sys.path.insert(0, "configs")
import vit_digits

def sigterm_after(module, name):   # the signal arrives during this step of the set-up
    original = getattr(module, name)
    def then_sigterm(*args, **kwargs):
        result = original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        return result
    setattr(module, name, then_sigterm)
    return lambda: setattr(module, name, original)

workdir, where = sys.argv[1], sys.argv[2]
undo = sigterm_after({"prepare": run_setup, "init_state": state_lib}[where], where)
config = vit_digits.get_config("tiny")
config.num_steps = 3
stopped = trainer.train(config, workdir)
saved = os.listdir(workdir + "/checkpoints") if os.path.exists(workdir) else "no workdir"
print("first:", stopped.step, stopped.preempted, saved, stopped.stop_line(), flush=True)
try:
    evaluator.evaluate(config, workdir)
except ValueError as e:
    print("eval:", e, flush=True)
undo()
stopped = trainer.train(config, workdir, stop_after=2)
print("second:", stopped.step, stopped.preempted, stopped.stop_line(), flush=True)
undo = sigterm_after(run_setup, "prepare")   # a resume stopped in its set-up
stopped = trainer.train(config, workdir)
print("third:", stopped.step, stopped.preempted, stopped.stop_line(), flush=True)
undo()
finished = trainer.train(config, workdir)
print("fourth:", finished.step, finished.preempted, finished.stop_line(), flush=True)
"""


@pytest.mark.parametrize("where", ["prepare", "init_state"])
def test_sigterm_during_setup_stops_cleanly_and_the_rerun_trains(tmp_path, where):
    """SIGTERM before the first step: no crash, nothing saved (before the workdir is written
    when it comes that early), a message that says so, and the same command trains
    afterwards; a resume stopped in its set-up says which step it will resume from."""
    workdir = tmp_path / "run"
    done = _run("-c", SIGTERM_DURING_SETUP, str(workdir), where)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.count("SIGTERM: stopping before the first step; nothing new to save") \
        == 2, done.stderr[-2000:]
    assert "will save a checkpoint" not in done.stderr
    lines = done.stdout.splitlines()
    saved = "no workdir" if where == "prepare" else "[]"
    assert f"first: 0 True {saved} stopped before the first step of this run: nothing new to " \
           "save; rerun to start" in lines, done.stdout
    assert "second: 2 True preempted: checkpoint saved at step 2; rerun to resume" in lines
    assert "third: 2 True stopped before the first step of this run: nothing new to save; " \
           "rerun to resume from step 2" in lines, done.stdout
    assert "fourth: 3 False None" in lines, done.stdout
    if where == "init_state":
        assert f"eval: {workdir / 'checkpoints'} holds no saved step yet: train there first" \
            in done.stdout


SIGTERM_AFTER_THE_RUN = """
import os, signal, time
from posjax import cli
from posjax.training import evaluator
from posjax.training import run_setup
from posjax.training import trainer
print(cli.run_command(lambda: "finished"), flush=True)
os.kill(os.getpid(), signal.SIGTERM)   # as a scheduler ending the job during shutdown
time.sleep(30)                         # as a shutdown that would hang
print("not reached", flush=True)
"""


def test_a_sigterm_after_the_run_finished_ends_it_with_status_0():
    """Once train.py's / eval.py's work has returned, everything is written: a SIGTERM in the
    interpreter's shutdown ends the process at once with status 0 (by default the status
    would be 143, a 'preempted' job to restart)."""
    start = time.monotonic()
    done = _run("-c", SIGTERM_AFTER_THE_RUN)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["finished"] and time.monotonic() - start < 25


CTRL_C_WHILE_BUSY = """
import time
from posjax.io_utils import signals_to_receiver_thread
from posjax.training.stop_request import StopRequest
with signals_to_receiver_thread(), StopRequest() as stop:
    stop.begin_steps()   # as the training loop does before its first step
    print("ready", flush=True)
    time.sleep(float(__import__("sys").argv[1]))   # the main thread busy, as in a compile
print("finished, stop requested:", stop.requested, flush=True)
"""


def test_ctrl_c_while_the_main_thread_is_busy(tmp_path, terminal_signals):
    """As in train(): signals reach the receiver thread. One Ctrl-C is seen at once and only
    asks for a stop; a second aborts at once (status 130), not when the busy call returns."""
    def run(busy_s: str, presses: int) -> tuple[subprocess.CompletedProcess, float]:
        proc = subprocess.Popen([sys.executable, "-c", CTRL_C_WHILE_BUSY, busy_s], cwd=ROOT,
                                env=_env(), text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        assert proc.stdout.readline() == "ready\n"
        start = time.monotonic()
        for _ in range(presses):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
        out, err = proc.communicate(timeout=60)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), \
            time.monotonic() - start

    once, _ = run("3", 1)
    assert once.returncode == 0, once.stderr[-2000:]
    assert once.stdout == "finished, stop requested: True\n"
    assert "SIGINT: will save a checkpoint after the current step and exit; Ctrl-C again " \
           "aborts without saving" in once.stderr
    twice, seconds = run("30", 2)
    assert twice.returncode == 130, twice.stdout + twice.stderr[-2000:]
    assert twice.stderr.rstrip().endswith("aborted by Ctrl-C") and seconds < 15
    assert "finished" not in twice.stdout


def _group_members(pgid: int) -> list[str]:
    """Live (not zombie) processes of process group ``pgid``, as 'pid command' lines."""
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)], capture_output=True,
                         text=True).stdout
    return [ln for ln in out.splitlines() if ln.split()[1][0] != "Z"]


def test_sigterm_to_the_process_group_with_input_workers_saves(tmp_path):
    """``timeout`` and Slurm signal every process of the job: the Grain workers must keep
    serving until the main process has saved, then end with it, leaving no shared memory to
    the resource tracker."""
    workdir = tmp_path / "run"
    args = ["train.py", *TINY, "--config.num_steps=400", "--config.log_every_steps=10",
            "--config.data.worker_count=2", "--config.checkpoint.every_steps=100000",
            f"--workdir={workdir}"]
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 10/400"):
            os.killpg(proc.pid, signal.SIGTERM)
            break
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "preempted: checkpoint saved at step" in out, out[-3000:]
    assert "leaked shared_memory" not in out, out[-3000:]
    stopped = int(out.split("preempted: checkpoint saved at step ")[1].split(";")[0])
    assert (workdir / "checkpoints" / str(stopped)).is_dir()
    deadline = time.monotonic() + 20    # the workers and the resource tracker end after it
    while _group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group_members(proc.pid) == []


def test_a_run_with_input_workers_ends_without_leaking_shared_memory(tmp_path):
    """To the end, with its final evaluation: both pipelines' batches are freed before exit."""
    done = _run("train.py", *TINY, "--config.num_steps=20", "--config.data.worker_count=2",
                f"--workdir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final eval at step 20" in done.stdout
    assert "leaked shared_memory" not in done.stderr, done.stderr[-3000:]


def test_divergence_stops_before_saving_a_non_finite_state(tmp_path):
    """lr 1e30 makes the loss NaN from step 3 on: the run ends with one error and keeps only
    the checkpoints saved before, whether the check comes at a save or at a log."""
    at_save = _run("train.py", *TINY, "--config.num_steps=30", "--config.log_every_steps=10",
                   "--config.checkpoint.every_steps=2", "--config.optimizer.learning_rate=1e30",
                   f"--workdir={tmp_path / 'a'}")
    assert at_save.returncode == 1 and "Traceback" not in at_save.stderr
    assert at_save.stderr.strip().splitlines()[-1].startswith(
        "error: training diverged by step 4 (the loss or gradient norm became NaN or infinite); "
        "it was stopped before saving that state: the checkpoints saved before hold finite "
        "values (latest: step 2, which may already be on the way to diverging).")
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["2"]

    at_log = _run("train.py", *TINY, "--config.num_steps=30", "--config.log_every_steps=1",
                  "--config.checkpoint.every_steps=100", "--config.optimizer.learning_rate=1e30",
                  f"--workdir={tmp_path / 'b'}")
    assert at_log.returncode == 1 and "Traceback" not in at_log.stderr
    assert "error: training diverged by step 3 (the loss or gradient norm became" in at_log.stderr
    assert "no checkpoint was saved" in at_log.stderr
    assert not list((tmp_path / "b" / "checkpoints").iterdir())
    logged = [json.loads(ln) for ln in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3] and math.isnan(logged[-1]["loss"])


HOLD_WORKDIR = """
import pathlib, sys, time
from posjax.training.checkpointing import lock
with lock.exclusive(pathlib.Path(sys.argv[1])):   # as a training run does
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_second_run_in_a_workdir_in_use_is_refused_until_the_first_ends(tmp_path):
    """While a run holds the workdir, another train.py there exits 1 with one message naming
    the holder, before it writes anything, also once the holder's record is deleted; once the
    holder is gone, even by SIGKILL, the workdir is free (no stale lock)."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_WORKDIR, str(workdir)], cwd=ROOT,
                              env=_env(), text=True, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == "holding\n"
        held = (workdir / "train.lock").read_text()
        refused = _run("train.py", *TINY, f"--workdir={workdir}")
        (workdir / "train.lock").unlink()   # the lock is on the workdir, not on this record
        unrecorded = _run("train.py", *TINY, f"--workdir={workdir}")
    finally:
        holder.kill()
        holder.wait()
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith(
        f"error: workdir '{workdir}' is in use by another training run (pid {holder.pid} on "
        "host "), refused.stderr[-2000:]
    assert "wait for it to end, or stop it (SIGTERM saves a checkpoint)" in refused.stderr
    assert held.startswith(f'{{"pid": {holder.pid}, ')
    assert unrecorded.returncode == 1 and unrecorded.stderr.strip().splitlines()[-1].startswith(
        f"error: workdir '{workdir}' is in use by another training run (a process that has "
        "not recorded itself yet)"), unrecorded.stderr[-2000:]
    assert list(workdir.iterdir()) == []
    freed = _run("train.py", *TINY, f"--workdir={workdir}")
    assert freed.returncode == 0, freed.stderr[-2000:]
    assert "final eval at step 6" in freed.stdout
    assert not (workdir / "train.lock").exists()   # the record goes with the run


# The rest of the command line run with files capped at 8 KiB (set here, not in a fork of the
# multithreaded test process; the limit passes through exec).
FILES_CAPPED = """
import os, resource, sys
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)   # an entry cut at 8 KiB would stay there
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def test_a_save_that_fails_for_lack_of_space_is_one_error_naming_the_step(tmp_path):
    """Files capped at 8 KiB (as a full disk fails writes): step 2's background save fails;
    the run stops at its next save with one error naming step 2, the cause and the way out,
    with Orbax's errors on one line each (four tracebacks, 770 lines, before); without the cap
    the same command then trains. Resumed from step 2 under the cap, it names step 4 and says
    step 2 is intact."""
    workdir = tmp_path / "run"
    full = _run("-c", FILES_CAPPED, "train.py", *TINY, f"--workdir={workdir}")
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the checkpoint of step 2 could not be written in "
                           f"{workdir / 'checkpoints'} ("), last
    assert "File too large" in last and last.endswith(
        "is the disk full, or the folder no longer writable? No checkpoint was complete yet; "
        "fix the storage, then start again"), last
    assert len(full.stderr.splitlines()) < 15, full.stderr[-3000:]
    again = _run("train.py", *TINY, f"--workdir={workdir}")
    assert again.returncode == 0 and "final eval at step 6" in again.stdout, again.stderr[-2000:]
    for later in ("4", "6", "eval_6_test.json"):   # as if stopped after step 2's save
        shutil.rmtree(workdir / "checkpoints" / later, ignore_errors=True)
    (workdir / "checkpoints" / "eval_6_test.json").unlink()
    resumed = _run("-c", FILES_CAPPED, "train.py", *TINY, f"--workdir={workdir}")
    last = resumed.stderr.strip().splitlines()[-1]
    assert resumed.returncode == 1 and last.startswith(
        "error: the checkpoint of step 4 could not be written in "), resumed.stderr[-3000:]
    assert last.endswith("The checkpoints saved before are intact (the latest: step 2); fix the "
                         "storage, then start this run again to resume from there"), last
    assert [p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()] == ["2"]
    # Step 2 still matches its integrity record, and the half-written step 4 is never resumed.
    from posjax.training.checkpointing import integrity
    assert integrity.damage(workdir / "checkpoints" / "2") is None
    assert (workdir / "checkpoints" / "2" / integrity.RECORD_FILE).is_file()
    done = _run("train.py", *TINY, f"--workdir={workdir}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resuming from {workdir / 'checkpoints' / '2'}" in done.stdout
    assert "damaged" not in done.stderr and "final eval at step 6" in done.stdout


def test_a_metrics_log_that_cannot_be_written_is_one_error(tmp_path):
    """Files capped at 8 KiB: the metrics log fills first. Before, the run ended in a traceback
    from TensorBoard's writer, and its thread and its flush at exit printed two more; now it
    is one error naming the files."""
    workdir = tmp_path / "run"
    done = _run("-c", FILES_CAPPED, "train.py", *TINY, "--config.num_steps=80",
                "--config.log_every_steps=1", "--config.checkpoint.every_steps=1000",
                f"--workdir={workdir}")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: the metrics log ({workdir / 'metrics.jsonl'} and {workdir / 'tensorboard'}) "
        "could not be written (OSError: File too large): is the disk full, or the folder no "
        "longer writable? Fix the storage, then run the command again (a training run resumes "
        "from its latest checkpoint)")


BACKGROUND_SAVE = """
import sys, time
import grain, numpy as np
from posjax.io_utils import SaveFailed
from posjax.training.checkpointing.checkpointer import Checkpointer
checkpointer = Checkpointer(sys.argv[1], every_steps=1, keep=0)
iterator = iter(grain.MapDataset.range(4).to_iter_dataset())
checkpointer.save(1, {"weights": np.random.default_rng(0).random(100_000, np.float32)},
                iterator)   # 400 kB that do not compress
while checkpointer.manager.is_saving_in_progress():
    time.sleep(0.05)
try:
    checkpointer.check_background_save()
except SaveFailed as e:
    print("raised:", str(e)[:60], flush=True)
checkpointer.close()
print("closed", flush=True)
"""


def test_a_failed_background_save_is_raised_between_steps(tmp_path):
    """As soon as the background save has ended (here: failed on an 8 KiB file cap), the check
    the loop makes after every step raises it: not a save interval of steps later."""
    done = _run("-c", FILES_CAPPED, "-c", BACKGROUND_SAVE, str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        f"raised: the checkpoint of step 1 could not be written in {tmp_path}"[:68], "closed"], \
        done.stdout + done.stderr[-2000:]
