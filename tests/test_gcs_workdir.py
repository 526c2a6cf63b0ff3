"""A training run with ``--workdir gs://...`` on gcp-storage-emulator (tests/gcs_emulator.py):
train with checkpoints, stop, resume to the end, evaluate; what the run writes is in the
bucket (config.json, metrics.jsonl with every step once, the checkpoints, the eval JSON)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import uuid

import pytest

import synthetic_runs as syn
from posjax import storage
from posjax.training import evaluator, trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _names(workdir: str) -> list[str]:
    """The objects under ``workdir``, relative to it."""
    with storage._object(workdir) as (kv, prefix):
        names = kv.list(kv.KeyRange(prefix + "/", prefix + "0")).result()
    return sorted(n.decode()[len(prefix) + 1:] for n in names)


def _read(path: str) -> bytes:
    found = storage.read_with_generation(path)
    assert found is not None, f"{path} is not in the bucket"
    return found[0]


def _losses(metrics: str) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in metrics.splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["split"] == "train"]


@pytest.fixture
def workdir(emulator) -> str:
    return f"{emulator}/run-{uuid.uuid4().hex[:8]}"


def test_train_stop_resume_evaluate_on_a_bucket(workdir, tmp_path):
    config = syn.tiny_config()
    first = trainer.train(config, workdir, stop_after=3)
    assert first.preempted and first.step == 3
    names = _names(workdir)
    assert "config.json" in names and "metrics.jsonl" in names
    assert any(n.startswith("checkpoints/2/") for n in names)
    assert "train.lock" not in names   # released at the end
    second = trainer.train(config, workdir)
    assert (second.start, second.step, second.preempted) == (3, 6, False)
    records = [json.loads(line) for line in _read(f"{workdir}/metrics.jsonl").splitlines()]
    train_steps = [r["step"] for r in records if r["split"] == "train"]
    assert train_steps == [1, 2, 3, 4, 5, 6], "every step logged once"
    assert json.loads(_read(f"{workdir}/config.json"))["num_steps"] == 6
    names = _names(workdir)
    for step in (2, 3, 4, 6):   # committed (Orbax in place), with their integrity records
        assert {f"checkpoints/{step}/commit_success.txt",
                f"checkpoints/{step}/integrity.json"} <= set(names), step
    assert {"checkpoints/eval_6_test.json", "loss_curve.png"} <= set(names)
    assert sum(n.startswith("tensorboard/events") for n in names) == 2   # one per launch
    result = evaluator.evaluate(config, workdir)
    assert result["step"] == 6
    saved = json.loads(_read(f"{workdir}/checkpoints/eval_6_test.json"))
    assert saved["step"] == 6 and saved["accuracy"] == pytest.approx(result["accuracy"])
    # init_from a run in a bucket: its newest committed step's weights, as they are
    pretrained = syn.tiny_config()
    pretrained.init_from = workdir
    from_bucket = evaluator.evaluate(pretrained, tmp_path / "from_bucket")
    assert from_bucket["step"] == 0 and from_bucket["accuracy"] == result["accuracy"]
    # The stopped and resumed run ends as an uninterrupted one in a local folder.
    local = trainer.train(config, tmp_path / "local")
    assert local.eval == second.eval
    assert (_losses(_read(f"{workdir}/metrics.jsonl").decode())
            == _losses((tmp_path / "local" / "metrics.jsonl").read_text()))


def _train_steps(workdir: str) -> list[int]:
    records = [json.loads(line) for line in _read(f"{workdir}/metrics.jsonl").splitlines()]
    return [r["step"] for r in records if r["split"] == "train"]


def test_a_partial_save_is_removed_and_a_damaged_step_moved_aside(workdir):
    config = syn.tiny_config()
    assert trainer.train(config, workdir, stop_after=5).step == 5   # saved: 2, 4, 5
    checkpoints = f"{workdir}/checkpoints"
    # Step 5 as a run killed mid-save leaves it on a bucket: no commit_success.txt.
    found = storage.read_with_generation(f"{checkpoints}/5/commit_success.txt")
    assert storage.delete_if_generation(f"{checkpoints}/5/commit_success.txt", found[1])
    # Step 4 with an object cut short.
    victim = next(n for n in _names(f"{checkpoints}/4")
                  if n.startswith("state/") and len(_read(f"{checkpoints}/4/{n}")) > 8)
    storage.write_atomically(f"{checkpoints}/4/{victim}", _read(f"{checkpoints}/4/{victim}")[:8])
    result = trainer.train(config, workdir)
    assert (result.start, result.step) == (2, 6)
    names = _names(workdir)
    assert not any(n.startswith("checkpoints/5/") for n in names), "the partial save is gone"
    assert f"checkpoints/4.damaged-truncated/{victim}" in names
    assert not any(n.startswith("checkpoints/4/") for n in names)
    assert _train_steps(workdir) == [1, 2, 3, 4, 5, 6]


def test_a_second_run_is_refused_naming_the_holder(workdir):
    """Refused as soon as the holder is seen renewing its lease (alive), not after the
    30 s + 10 s a lease of a run killed moments ago is waited for."""
    with storage.bucket_lease(workdir, renew_s=0.2, expire_s=0.6) as lost:   # another run
        holder = json.loads(_read(f"{workdir}/train.lock"))
        start = time.monotonic()
        with pytest.raises(ValueError, match=rf"in use by another training run \(pid "
                                             rf"{holder['pid']} on host {holder['host']}"):
            trainer.train(syn.tiny_config(num_steps=2), workdir)
        assert time.monotonic() - start < 10
        assert not lost.is_set(), "the holder kept its lease"
    assert "checkpoints/2/commit_success.txt" not in _names(workdir)


def test_the_lease_of_a_run_killed_moments_ago_is_taken_over(workdir, monkeypatch):
    from posjax.training.checkpointing import lock
    monkeypatch.setattr(lock, "LEASE_RENEW_S", 0.2)
    monkeypatch.setattr(lock, "LEASE_EXPIRE_S", 0.6)
    # A lease renewed just now by a run that is gone (SIGKILL: no renewal, no delete).
    dead = {"pid": 1, "host": "gone", "token": "x", "since": "then", "renewed": time.time()}
    assert storage.create_only(f"{workdir}/train.lock", json.dumps(dead).encode())
    result = trainer.train(syn.tiny_config(num_steps=2), workdir)
    assert (result.step, result.preempted) == (2, False)
    assert "train.lock" not in _names(workdir)


def test_a_lost_lease_stops_the_run_at_its_next_save(workdir, monkeypatch):
    from posjax.io_utils import SaveFailed
    from posjax.training.checkpointing import lock
    monkeypatch.setattr(lock, "LEASE_RENEW_S", 0.1)
    with lock.exclusive(storage.as_path(workdir)):
        lock.check_held()
        storage.write_atomically(f"{workdir}/train.lock", b"{}")   # taken over meanwhile
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not lock._lease_lost.is_set():
            time.sleep(0.05)
        with pytest.raises(SaveFailed, match="lost its lease on the workdir"):
            lock.check_held()
    lock.check_held()   # no lease held: nothing to lose


def test_train_py_and_eval_py_take_a_gs_workdir(workdir):
    """The commands as the README shows them, STORAGE_EMULATOR_HOST in their environment;
    eval.py reads the run's config.json from the bucket (no --config)."""
    from jax_env import xla_flags
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(), "PYTHONPATH": str(ROOT)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)

    trained = run("train.py", "--config", "configs/vit_digits.py:tiny", f"--workdir={workdir}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "final eval at step 6" in trained.stdout
    evaluated = run("eval.py", f"--workdir={workdir}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout[evaluated.stdout.index("{"):])["step"] == 6
    assert json.loads(_read(f"{workdir}/checkpoints/eval_6_test.json"))["step"] == 6


def test_no_credentials_is_one_error_before_anything_runs(tmp_path):
    """Without an emulator and without Google Cloud credentials (no key file, no gcloud
    login, no metadata server), ``--workdir gs://`` is one error naming the fix, in seconds,
    instead of a hang in the clients' retries after the step compiled."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
        "GOOGLE_APPLICATION_CREDENTIALS")}
    env.update(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
               GCE_METADATA_HOST="127.0.0.1:9", GCE_METADATA_IP="127.0.0.1:9",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "train.py", "--config", "configs/vit_digits.py:tiny",
                           "--workdir=gs://some-bucket/run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    err = done.stderr.strip().splitlines()
    assert err[-1].startswith("error: --workdir gs://some-bucket/run: no Google Cloud "
                              "credentials found"), done.stderr[-2000:]
    assert "gcloud auth application-default login" in err[-1]
    assert "Traceback" not in done.stderr and "compil" not in done.stdout + done.stderr


def test_two_processes_train_on_a_bucket_and_stop_together_when_the_lease_is_lost(
        workdir, tmp_path):
    """2 gloo processes, one gs:// workdir: process 1 given another bucket folder is refused
    by both before anything is written; on the same folder they train and save, and when
    process 0's lease is taken over (train.lock overwritten) both stop at the next save with
    the lease error (process 1 hears it from process 0), not process 0 alone while process 1
    waits in Orbax's barrier."""
    import test_multiprocess as mp

    other = workdir + "-other"
    results = mp.launch(workdir, tmp_path, "unshared", extra_flags={1: [f"--workdir={other}"]})
    for i, (out, code) in enumerate(results):
        assert code != 0 and f"process {i}: error: workdir " in out, out[-3000:]
        assert "the processes were given other workdirs" in out, out[-3000:]
    assert _names(workdir) == [] and _names(other) == []

    overrides = {**mp.OVERRIDES, "num_steps": 4000, "log_every_steps": 10,
                 "checkpoint.every_steps": 40}
    logs = [tmp_path / f"lease_{i}.log" for i in range(2)]
    flags = [f"--config.{k}={v}" for k, v in {**overrides, **mp.MULTI}.items()]
    procs, copiers = mp.start(workdir, logs, "configs/vit_digits.py:tiny", flags)
    try:
        while procs[0].poll() is None and "step 40/4000 " not in logs[0].read_text():
            time.sleep(0.05)
        storage.write_atomically(f"{workdir}/train.lock", b"{}")   # another run took it over
    except BaseException:
        mp.stop_all(procs, copiers)
        raise
    codes = mp.wait_all(procs, copiers)
    for i, (log, code) in enumerate(zip(logs, codes)):
        out = log.read_text()
        assert code != 0 and "lost its lease on the workdir" in out, out[-3000:]
        assert "step 4000/4000 " not in out, out[-3000:]
    assert "checkpoints/40/commit_success.txt" in _names(workdir)


def test_a_bucket_that_refuses_writes_is_one_error_naming_the_step(workdir, monkeypatch):
    """The bucket refuses step 4's objects (403 quotaExceeded: over quota, billing disabled,
    permission revoked) while the run saves in the background: the run stops with one
    SaveFailed naming step 4, the bucket's answer and the intact step 2; the next run, once
    the bucket takes writes again, resumes from step 2 to the uninterrupted end."""
    import gcs_emulator
    from posjax.io_utils import SaveFailed
    config = syn.tiny_config()
    with monkeypatch.context() as refusing:
        gcs_emulator.refuse_uploads(refusing, lambda name: "/checkpoints/4/" in name)
        with pytest.raises(SaveFailed) as failed:
            trainer.train(config, workdir)
    message = str(failed.value)
    assert message.startswith(f"the checkpoint of step 4 could not be written in "
                              f"{workdir}/checkpoints ("), message
    assert "Forbidden" in message and "\n" not in message, message   # gcsfs drops the reason
    assert "write access to the bucket (its quota, billing, permissions)?" in message, message
    assert message.endswith("The checkpoints saved before are intact (the latest: step 2); "
                            "fix the storage, then start this run again to resume from there")
    assert "train.lock" not in _names(workdir), "the lease is released"
    result = trainer.train(config, workdir)
    assert (result.start, result.step) == (2, 6)
    assert _train_steps(workdir)[-4:] == [3, 4, 5, 6]


SHORT_LEASE = """
import runpy, sys
from posjax.training.checkpointing import lock
lock.LEASE_RENEW_S, lock.LEASE_EXPIRE_S = 0.5, 2.0   # a killed run's lease expires in 2 s
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_run_killed_mid_save_on_a_bucket_resumes_as_the_uninterrupted_run(workdir, tmp_path):
    """train.py killed with SIGKILL while a step's objects are being uploaded (a step folder
    without commit_success.txt, an earlier step committed): the rerun takes the dead run's
    lease over, removes the partial step, resumes from the last committed one and ends as
    the uninterrupted run in a local folder (the same loss at every step, each logged once;
    the same final eval)."""
    from jax_env import xla_flags
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(), "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", SHORT_LEASE, "train.py", "--config",
            "configs/vit_digits.py:tiny", "--config.num_steps=40",
            "--config.checkpoint.every_steps=4", "--config.log_every_steps=1"]
    log = tmp_path / "killed.log"
    with log.open("w") as out:
        victim = subprocess.Popen([*args, f"--workdir={workdir}"], cwd=ROOT, env=env,
                                  stdout=out, stderr=subprocess.STDOUT)
    partial = None
    try:
        deadline = time.monotonic() + 240
        while victim.poll() is None and partial is None and time.monotonic() < deadline:
            names = _names(f"{workdir}/checkpoints")
            steps = {n.split("/")[0] for n in names if n.split("/")[0].isdigit()}
            committed = {s for s in steps if f"{s}/commit_success.txt" in names}
            if committed and steps - committed:
                partial = max(steps - committed, key=int)
                victim.kill()
            time.sleep(0.01)
    finally:
        victim.kill()
        victim.wait()
    assert partial is not None, "no save was seen in flight:\n" + log.read_text()[-3000:]
    assert "final eval" not in log.read_text()

    def run(target: str) -> subprocess.CompletedProcess:
        return subprocess.run([*args, f"--workdir={target}"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    resumed = run(workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "final eval at step 40" in resumed.stdout
    straight = run(str(tmp_path / "local"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert _train_steps(workdir) == list(range(1, 41)), "every step logged once"
    assert (_losses(_read(f"{workdir}/metrics.jsonl").decode())
            == _losses((tmp_path / "local" / "metrics.jsonl").read_text()))
    assert (json.loads(_read(f"{workdir}/checkpoints/eval_40_test.json"))["accuracy"]
            == json.loads((tmp_path / "local/checkpoints/eval_40_test.json").read_text())[
                "accuracy"])
    names = _names(f"{workdir}/checkpoints")
    assert f"{partial}/commit_success.txt" in names or not any(
        n.startswith(f"{partial}/") for n in names)   # saved again by the rerun, or gone
    assert "train.lock" not in _names(workdir)


def test_a_run_extended_on_a_bucket_continues_as_on_a_disk(workdir, tmp_path):
    """Resumed with more steps on a bucket: the same schedule segments (lr_schedule.json), the
    same loss and rate at every step as the same extension in a local folder, config.json
    updated; a key that changes what the checkpoint means stays refused there too."""
    local = tmp_path / "local"
    longer = syn.tiny_config(num_steps=10)
    for target in (workdir, local):
        assert trainer.train(syn.tiny_config(), target, stop_after=4).step == 4
        assert trainer.train(longer, target).step == 10
    assert (json.loads(_read(f"{workdir}/lr_schedule.json"))
            == json.loads((local / "lr_schedule.json").read_text())
            == {"segments": [[0, 6], [4, 10]]})
    assert json.loads(_read(f"{workdir}/config.json"))["num_steps"] == 10
    records = [json.loads(line) for line in _read(f"{workdir}/metrics.jsonl").splitlines()]
    on_disk = [json.loads(line) for line in (local / "metrics.jsonl").read_text().splitlines()]
    assert ([(r["step"], r["loss"], r["lr"]) for r in records if r["split"] == "train"]
            == [(r["step"], r["loss"], r["lr"]) for r in on_disk if r["split"] == "train"])
    with pytest.raises(ValueError, match="batch_size"):
        trainer.train(syn.tiny_config(num_steps=12, batch_size=8), workdir)


def test_a_metrics_log_the_bucket_refuses_is_one_error(workdir, monkeypatch):
    """The bucket refuses metrics.jsonl (403): one SaveFailed naming the metrics log, as a full
    disk does."""
    from posjax.io_utils import SaveFailed
    import gcs_emulator
    gcs_emulator.refuse_uploads(monkeypatch, lambda name: name.endswith("/metrics.jsonl"))
    with pytest.raises(SaveFailed) as failed:
        trainer.train(syn.tiny_config(), workdir)
    message = str(failed.value)
    assert message.startswith(f"the metrics log ({workdir}/metrics.jsonl and "), message
    assert "PERMISSION_DENIED: quotaExceeded" in message and "\n" not in message, message
    assert "http_response_body" not in message and message.endswith(
        "does this account still have write access to the bucket (its quota, billing, "
        "permissions)? Fix the storage, then run the command again (a training run resumes "
        "from its latest checkpoint)"), message
