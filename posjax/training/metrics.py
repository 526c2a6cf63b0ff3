"""Metrics: accumulation of step metrics, TensorBoard + JSONL writing, console progress (MFU
against ``peak_flops``), the loss curve.

Files under the workdir (written by process 0 only):
``metrics.jsonl``  one JSON object per line: {"step", "split" ("train"|"eval"), metric: value};
``tensorboard/``   the same scalars as ``<split>/<metric>`` (tensorboardX);
``loss_curve.png`` train loss (and eval accuracy) against step, drawn at the end of training.

"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import pathlib
import sys
import time
from typing import Any, Mapping, Sequence

import jax

from posjax import storage
from posjax.io_utils import write_text_atomically, writing


class MetricAccumulator:
    """Sums step metrics {name: (sum, weight)} and scalar extras on device until ``result``."""

    def __init__(self):
        self._sums: dict[str, Any] = {}
        self._count = 0

    def add(self, metrics: Mapping[str, Any]) -> None:
        for name, value in metrics.items():
            pair = value if isinstance(value, tuple) else (value, 1.0)
            old = self._sums.get(name)
            self._sums[name] = pair if old is None else (old[0] + pair[0], old[1] + pair[1])
        self._count += 1

    def all_finite(self, names: Sequence[str]) -> bool:
        """Whether the sums and weights of ``names`` since the last reset are all finite (a
        zero weight is fine: e.g. an MLM batch without masked tokens)."""
        fetched = jax.device_get({k: v for k, v in self._sums.items() if k in names})
        return all(math.isfinite(float(x)) for pair in fetched.values() for x in pair)

    def result(self) -> dict[str, float]:
        """{name: Σsum / Σweight} (host floats) and reset."""
        fetched = jax.device_get(self._sums)
        self._sums, self._count = {}, 0
        return {k: float(s) / float(w) if float(w) else float("nan")
                for k, (s, w) in fetched.items()}


class MetricWriter:
    """metrics.jsonl + TensorBoard on process 0 (a no-op elsewhere).

    Resuming at ``start_step``: records of later steps are dropped from metrics.jsonl
    (``drop_after``) and TensorBoard is told to purge its events of steps > start_step, so the
    steps about to be recomputed appear once and those up to the checkpoint stay.
    """

    def __init__(self, workdir: str | pathlib.Path, enabled: bool, start_step: int):
        self.enabled = enabled
        self.path = storage.path(workdir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        with self._writing():
            drop_after(self.path, start_step)
            self._tb = EventFile(storage.path(workdir) / "tensorboard",
                                 purge_step=start_step + 1 if start_step else None,
                                 suffix=f".from_step_{start_step}")

    def _writing(self):
        """A failed write (a full disk) is one SaveFailed naming these files."""
        return writing(f"the metrics log ({self.path} and {self.path.parent / 'tensorboard'})")

    def write(self, step: int, split: str, scalars: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        with self._writing():
            line = json.dumps({"step": int(step), "split": split, **scalars})
            if storage.is_bucket(self.path):   # read and rewritten: storage.append_line
                storage.append_line(self.path, line)
            else:
                with self.path.open("a") as f:
                    f.write(line + "\n")
            self._tb.write(step, {f"{split}/{name}": value for name, value in scalars.items()})

    def write_once(self, step: int, split: str, scalars: Mapping[str, float]) -> None:
        """``write`` unless metrics.jsonl already holds a ``split`` record of ``step`` (the
        final eval of a run killed between logging it and writing its JSON, then rerun)."""
        if self.enabled and not any(r.get("step") == step and r.get("split") == split
                                    for r in read_metrics(self.path)):
            self.write(step, split, scalars)

    def close(self) -> None:
        """Close the TensorBoard file (a no-op once closed)."""
        tb, self._tb = self._tb, None
        if tb is not None:
            with self._writing():
                tb.close()

    def __enter__(self) -> "MetricWriter":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        """Closed; after an error, quietly (a full disk: closing fails again, and must not
        replace the error; the records stay as written, each flushed). A TensorBoard file
        left open on a bucket would upload itself when collected, possibly after its
        storage is gone, and retry for two minutes."""
        if exc_type is None:
            self.close()
        else:
            with contextlib.suppress(Exception):
                self.close()


class EventFile:
    """TensorBoard scalars in one event file of ``folder``, written and flushed synchronously
    (tensorboardX's event format; its SummaryWriter writes from a thread of its own and again
    at exit, so a full disk printed their tracebacks after the run's one error).

    ``purge_step``: TensorBoard hides the events of earlier files at steps >= it (a resumed
    run's steps after its checkpoint). ``suffix`` ends the file name, which is otherwise made
    of the time in seconds and the host: a resumed writer starting within the same second as
    its predecessor must not reuse (truncate) that file."""

    def __init__(self, folder: pathlib.Path, purge_step: int | None, suffix: str):
        _import_tensorboardx_without_torch()
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import SessionLog
        folder.mkdir(parents=True, exist_ok=True)
        self._events = EventsWriter(str(folder / "events"), suffix)
        if purge_step is not None:
            self._write(step=purge_step, session_log=SessionLog(status=SessionLog.START))

    def _write(self, **fields: Any) -> None:
        from tensorboardX.proto.event_pb2 import Event
        self._events.write_event(Event(wall_time=time.time(), **fields))
        self._events.flush()

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        from tensorboardX.proto.summary_pb2 import Summary
        self._write(step=int(step), summary=Summary(value=[
            Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]))

    def close(self) -> None:
        self._events.close()


def _import_tensorboardx_without_torch() -> None:
    """Import tensorboardX with torch hidden, unless torch is loaded already. Its package
    imports its SummaryWriter, which imports torch where it is installed only to accept torch
    tensors (2.5 s and ~0.3 GB at every train.py and eval.py start); posjax writes the event
    protos itself. ``None`` in ``sys.modules`` makes ``import torch`` raise ImportError, which
    tensorboardX catches; the entry is removed after, so a later ``import torch`` works."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None
    try:
        import tensorboardX  # noqa: F401, PLC0415
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def drop_after(path: pathlib.Path, step: int) -> None:
    """Remove records of steps > ``step`` (logged after the checkpoint a run resumes from, so
    they are about to be recomputed), and lines that are not JSON records (a write cut short by
    a crash or a full disk). Rewrites the file atomically."""
    if not path.exists():
        return
    lines, records = _read_records(path)
    keep = [ln for ln, r in zip(lines, records) if r is not None and r.get("step", 0) <= step]
    if len(keep) != len(lines):
        write_text_atomically(path, "".join(ln + "\n" for ln in keep))


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (lines that are not JSON records are skipped)."""
    path = storage.path(path)
    if not path.exists():
        return []
    return [r for r in _read_records(path)[1] if r is not None]


def _read_records(path: pathlib.Path) -> tuple[list[str], list[dict[str, Any] | None]]:
    """(non-empty lines, each as a JSON object or None, with one warning naming the file,
    where it is not one)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    out: list[dict[str, Any] | None] = []
    for ln in lines:
        try:
            record = json.loads(ln)
        except ValueError:
            record = None
        out.append(record if isinstance(record, dict) else None)
    bad = [i + 1 for i, r in enumerate(out) if r is None]
    if bad:
        logging.warning("%s: line(s) %s are not JSON records (a write cut short?); skipped",
                        path, bad[:5])
    return lines, out


class Progress:
    """Console line per log interval: step, metrics, throughput and ETA. ``input_wait``: the
    seconds the loop has waited for its next batch since the last mark (the loop adds them)."""

    def __init__(self, num_steps: int, start_step: int):
        self.num_steps = num_steps
        self.mark_step = start_step
        self.mark_time = time.perf_counter()
        self.input_wait = 0.0

    def restart(self, step: int) -> None:
        """Start timing from ``step`` (called after compilation so it is not counted)."""
        self.mark_step, self.mark_time, self.input_wait = step, time.perf_counter(), 0.0

    def rate(self, step: int) -> tuple[float, float, float]:
        """(steps/s since the last mark, seconds elapsed, seconds of them waited for input);
        moves the mark to ``step``."""
        now = time.perf_counter()
        elapsed = now - self.mark_time
        steps = step - self.mark_step
        rate = steps / elapsed if steps > 0 and elapsed > 0 else float("nan")
        waited = self.input_wait
        self.mark_step, self.mark_time, self.input_wait = step, now, 0.0
        return rate, elapsed, waited

    def line(self, step: int, scalars: Mapping[str, float], steps_per_s: float) -> str:
        left = self.num_steps - step
        eta = (datetime.timedelta(seconds=round(left / steps_per_s))
               if steps_per_s > 0 and math.isfinite(steps_per_s) else "?")
        shown = " ".join(f"{k} {_fmt(v)}" for k, v in scalars.items())
        return f"step {step}/{self.num_steps}  {shown}  ETA {eta}"


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


EVAL_SCORES = ("score", "accuracy")   # the right axis of loss_curve.png: the first found


def curve_series(records: list[dict[str, Any]]
                 ) -> dict[str, list[tuple[int, float]]]:
    """The series of ``loss_curve.png`` from metrics records, by label: ``train loss``,
    ``eval loss`` and ``eval <score>`` (the first of ``EVAL_SCORES`` the eval records have:
    GLUE's task score, else accuracy), each [(step, value)], finite values only; empty
    series left out."""
    def series(split: str, key: str) -> list[tuple[int, float]]:
        return [(r["step"], float(r[key])) for r in records
                if r.get("split") == split and isinstance(r.get(key), (int, float))
                and math.isfinite(r[key])]

    out = {"train loss": series("train", "loss"), "eval loss": series("eval", "loss")}
    for key in EVAL_SCORES:
        if values := series("eval", key):
            out[f"eval {key}"] = values
            break
    return {label: values for label, values in out.items() if values}


def plot_curves(workdir: str | pathlib.Path) -> pathlib.Path | None:
    """``loss_curve.png``: train and eval loss (left axis) and the eval score (right axis,
    ``curve_series``), one legend under the axes; None without train losses."""
    workdir = storage.path(workdir)
    curves = curve_series(read_metrics(workdir / "metrics.jsonl"))
    if "train loss" not in curves:
        return None
    from posjax.plots import pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.4))
    lines = ax.plot(*zip(*curves.pop("train loss")), label="train loss", color="tab:blue")
    if "eval loss" in curves:
        lines += ax.plot(*zip(*curves.pop("eval loss")), "s--", label="eval loss",
                         color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    for label, values in curves.items():   # at most the one eval score
        score = ax.twinx()
        lines += score.plot(*zip(*values), "o-", label=label, color="tab:orange")
        score.set_ylabel(label)
    fig.legend(lines, [ln.get_label() for ln in lines], loc="lower center", ncol=len(lines),
               frameon=False)
    ax.set_title(workdir.name)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out = workdir / "loss_curve.png"
    save_figure(fig, out)
    return out
