"""A real 2-process run (127.0.0.1 coordinator, 2 x 4 CPU devices, gloo collectives) equals the
1-process 8-device run: same losses, same eval, same final parameters."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np

from posjax.training import checkpoint as ckpt_lib
from posjax.training import loop

import test_training_synthetic as syn

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent

WORKER = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
import test_training_synthetic as syn
from posjax.training import loop
import jax
config = syn.tiny_config(**{{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                            "distributed.enabled": True,
                            "distributed.coordinator_address": "127.0.0.1:{port}",
                            "distributed.num_processes": 2,
                            "distributed.process_id": int(sys.argv[1])}})
loop.maybe_initialize_distributed(config)
assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
loop.train(config, {workdir!r})
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_losses(workdir: pathlib.Path) -> dict[int, float]:
    records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def _final_params(config, workdir: pathlib.Path):
    run = loop.prepare(config, workdir, training=False)
    checkpointer = ckpt_lib.Checkpointer(workdir, 1, 0, create=False)
    state = checkpointer.restore(checkpointer.latest_step(), run.abstract)
    checkpointer.close()
    return jax.tree.map(np.asarray, state.params)


def test_two_processes_equal_one_process(tmp_path):
    multi, single = tmp_path / "two_processes", tmp_path / "one_process"
    code = WORKER.format(root=str(ROOT), tests=str(TESTS), port=_free_port(), workdir=str(multi))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    config = syn.tiny_config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    reference = loop.train(config, single)   # meanwhile, in this 8-device process
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]

    losses_multi, losses_single = _train_losses(multi), _train_losses(single)
    assert sorted(losses_multi) == list(range(1, 7))
    for step, loss in losses_single.items():
        assert abs(losses_multi[step] - loss) <= 1e-5, (step, losses_multi[step], loss)
    eval_multi = json.loads(loop.eval_file(multi, 6).read_text())
    assert eval_multi["num_examples"] == reference.eval["num_examples"] == 40
    assert abs(eval_multi["accuracy"] - reference.eval["accuracy"]) < 1e-9
    for a, b in zip(jax.tree.leaves(_final_params(config, multi)),
                    jax.tree.leaves(_final_params(config, single))):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-4)   # Adam: ~lr·sign(g) for g ≈ 0
    # Each process saved its own input-iterator state.
    assert sorted(p.name for p in (multi / "checkpoints" / "6" / "data_iter").glob("process_*")
                  ) == ["process_0-of-2.json", "process_1-of-2.json"]
