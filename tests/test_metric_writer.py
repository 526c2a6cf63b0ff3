"""Resuming a run keeps the logged history up to its checkpoint step in both metrics.jsonl and
TensorBoard, and drops only what is about to be recomputed."""
from __future__ import annotations

import os
import struct
import subprocess
import sys

from tensorboardX.proto import event_pb2

from posjax.training import metrics


def events(folder) -> list[event_pb2.Event]:
    """Every event of every TFRecord event file in ``folder`` (length, crc, data, crc)."""
    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12:i + 12 + length])
            out.append(event)
            i += 12 + length + 4
    return out


def test_resume_purges_only_the_steps_after_the_checkpoint(tmp_path):
    first = metrics.MetricWriter(tmp_path, enabled=True, start_step=0)
    for step in (1, 2, 3, 4):
        first.write(step, "train", {"loss": float(step)})
    first.close()
    resumed = metrics.MetricWriter(tmp_path, enabled=True, start_step=2)   # checkpoint at 2
    resumed.write(3, "train", {"loss": 30.0})
    resumed.close()

    assert [r["step"] for r in metrics.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    # A reader (TensorBoard) discards events at steps >= a START session log's step.
    starts = [e.step for e in events(tmp_path / "tensorboard")
              if e.HasField("session_log") and e.session_log.status == e.session_log.START]
    assert starts == [3]
    logged = [(e.step, e.summary.value[0].simple_value) for e in events(tmp_path / "tensorboard")
              if e.HasField("summary")]
    kept = [(s, v) for s, v in logged[:4] if s < starts[0]] + logged[4:]
    assert kept == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_a_line_cut_short_does_not_block_the_resume(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train", "loss": 1.0}\n{"step": 2, "split": "tr')
    assert metrics.read_metrics(path) == [{"step": 1, "split": "train", "loss": 1.0}]
    resumed = metrics.MetricWriter(tmp_path, enabled=True, start_step=1)
    resumed.write(2, "train", {"loss": 2.0})
    resumed.close()
    assert [r["step"] for r in metrics.read_metrics(path)] == [1, 2]
    assert str(path) in caplog.text and "not JSON records" in caplog.text


WRITE_EVENTS = """
import sys
from posjax.training import metrics
writer = metrics.MetricWriter(sys.argv[1], enabled=True, start_step=0)
writer.write(1, "train", {"loss": 1.0})
writer.close()
print("torch imported:", "torch" in sys.modules, flush=True)
import torch
print("torch after:", torch.ones(2).sum().item(), flush=True)
"""


def test_the_tensorboard_writer_does_not_import_torch(tmp_path):
    """tensorboardX's package imports torch where it is installed (2.5 s at every train.py
    and eval.py start, before): the writer hides it, and a later ``import torch`` works."""
    done = subprocess.run([sys.executable, "-c", WRITE_EVENTS, str(tmp_path)], text=True,
                          capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["torch imported: False", "torch after: 2.0"]
    assert [e.summary.value[0].simple_value for e in events(tmp_path / "tensorboard")
            if e.HasField("summary")] == [1.0]
