"""Evaluation: ``evaluate(config, workdir)`` (eval.py) restores a checkpoint (the newest intact
step: ``checkpointing.resume``, as a training run resumes), or evaluates ``config.init_from``'s
weights as step 0, and writes its result file (``write_eval``: ``workdir.eval_file``);
``run_evaluation`` is one pass over the test split, shared with the trainer's periodic and
final evaluations."""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import pathlib
import time
from typing import Any, Iterator

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from posjax import config_defaults
from posjax.io_utils import signals_to_receiver_thread, writing
from posjax.training import errors
from posjax.training import hosts
from posjax.training import init_from as init_from_lib
from posjax.training import mesh as mesh_lib
from posjax.training import processes
from posjax.training import run_setup
from posjax.training import state as state_lib
from posjax.training import steps as steps_lib
from posjax.training import workdir as workdir_lib
from posjax.training.checkpointing import integrity
from posjax.training.checkpointing import resume
from posjax.training.checkpointing.checkpointer import Checkpointer, DamagedStep


EVAL_PROGRESS_S = 10.0   # run_evaluation's progress lines: at most one per this many seconds


class EvalProgress:
    """Progress of one evaluation pass: a line when ``EVAL_PROGRESS_S`` have passed since the
    last one; rates count from the end of the first batch (its compile excluded)."""

    def __init__(self, num_batches: int | None) -> None:
        self.num_batches, self.done, self.examples = num_batches, 0, 0
        self.start: float | None = None
        self.last = self.start_examples = 0

    def batch_done(self, real_examples: int) -> str | None:
        self.done += 1
        self.examples += real_examples
        now = time.perf_counter()
        if self.start is None:
            self.start, self.last, self.start_examples = now, now, self.examples
            return None
        if now - self.last < EVAL_PROGRESS_S:
            return None
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        per_s = (self.done - 1) / elapsed
        eta = ("?" if self.num_batches is None else
               datetime.timedelta(seconds=round((self.num_batches - self.done) / per_s)))
        return (f"eval batch {self.done}/{self.num_batches or '?'}  examples_per_s "
                f"{(self.examples - self.start_examples) / elapsed:.4g}  ETA {eta}")


def run_evaluation(run: run_setup.Run, params: Any, eval_step,
                   batches: Iterator[dict[str, np.ndarray]],
                   num_batches: int | None, predictions_dir: pathlib.Path | None = None,
                   holds_state: bool = False) -> dict[str, float]:
    """One pass over the test split's ``batches`` (this process's, ``num_batches`` of them; a
    grain iterator, closed at the end to stop its input workers); per-example outputs gathered
    from every process, padded examples dropped, then ``task.summarize`` (and
    ``task.write_predictions`` into ``predictions_dir`` when given, on process 0). Prints a
    progress line (batches done, examples/s, ETA) at most every ``EVAL_PROGRESS_S``."""
    collected: dict[str, list[np.ndarray]] = {}
    progress = EvalProgress(num_batches)
    # Closing stops the input workers, as in train.
    with errors.memory_advice(run, evaluating=True, holds_state=holds_state), \
            contextlib.closing(batches):
        for local in batches:
            batch = mesh_lib.global_batch(local, run.mesh)
            outputs = dict(eval_step(params, batch))
            outputs["__mask__"] = batch["mask"]
            gathered = multihost_utils.process_allgather(outputs, tiled=True)
            for k, v in gathered.items():
                collected.setdefault(k, []).append(np.asarray(v))
            if (line := progress.batch_done(int(np.sum(gathered["__mask__"])))) is not None:
                hosts.print_main(line)
    feeds = mesh_lib.batch_feeds(run.mesh)
    # Each gathered batch in the order its examples were read (feed 0's rows first).
    collected = {k: [b[feeds.feed_order(len(b))] for b in v] for k, v in collected.items()}
    mask = np.concatenate(collected.pop("__mask__")).astype(bool)
    outputs = {k: np.concatenate(v)[mask] for k, v in collected.items()}
    if predictions_dir is not None and run.is_main:
        with writing(f"the predictions in {predictions_dir}"):
            run.task.write_predictions(outputs, predictions_dir)
    return run.task.summarize(outputs)


@signals_to_receiver_thread()   # input workers never die of a group SIGTERM
def evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path,
             step: int | None = None) -> dict[str, float]:
    """Evaluate the checkpoint at ``config.eval_step`` (or ``step``: eval.py's ``--step``;
    unset: the newest intact step) and write its metrics JSON. A step that is not a saved
    step's number, is not saved or is damaged is one ValueError naming ``eval_step`` and the
    intact steps. In a workdir that is not a run's (``evaluates_init_from``),
    ``config.init_from``'s weights are evaluated as they are, as step 0 (a published model on
    a recipe's data, e.g. to check it before fine-tuning)."""
    step = _requested_step(config, step)
    run = run_setup.prepare(config, workdir, training=False)
    if run.evaluates_init_from:
        if step not in (None, 0):
            raise ValueError(f"eval_step={step!r}: {run.workdir / 'checkpoints'} holds no saved "
                             "step; leave eval_step unset: eval.py then evaluates "
                             "config.init_from's weights (as step 0)")
        return _evaluate_init_from(run)
    if not _is_step_number(step):
        raise ValueError(f"eval_step={step!r} is not valid: give a saved step's number (an "
                         f"integer >= 0); {_choices(run.workdir)}")
    steps = integrity.saved_steps(run.workdir)
    latest = step is None
    if step is None and steps:
        step = steps[-1]
    step, steps = _process_0_choice(run.workdir, step, steps)
    if not steps:
        raise ValueError(f"{run.workdir / 'checkpoints'} holds no saved step yet: train there "
                         "first (a run stopped before its first save leaves it empty)")
    if step not in steps:
        raise ValueError(f"eval_step={step!r}: {run.workdir / 'checkpoints'} holds no such "
                         f"step; {_choices(run.workdir)}")
    pipe = run.make_eval_pipeline()     # data errors before the restore
    processes.check_same_splits({"test": pipe})
    state, step = _restore_for_eval(run.workdir, run.config.checkpoint, run.abstract, step,
                                    latest)
    params = state.params
    del state   # the optimizer state's buffers are freed: the devices hold only the params
    # A position table extended to a longer data.max_seq_length (model.extend_positions).
    model, params = run.task.for_evaluation(run.model, params)
    return _evaluate_and_write(run, model, params, step, pipe)


def _requested_step(config: ml_collections.ConfigDict, step: Any) -> Any:
    """The step asked for: ``config.eval_step``, or ``step`` (eval.py's ``--step``, the same
    setting spelt shorter); one ValueError when both are given and differ."""
    chosen = config.get("eval_step")
    if step is not None and chosen is not None and step != chosen:
        raise ValueError(f"--step {step} and eval_step={chosen!r} name different steps: give "
                         "one of them")
    return chosen if step is None else step


def _is_step_number(step: Any) -> bool:
    """None (the newest intact step) or an integer >= 0."""
    return step is None or (isinstance(step, (int, np.integer)) and not isinstance(step, bool)
                            and step >= 0)


def _choices(workdir: pathlib.Path, but: tuple[int, ...] = ()) -> str:
    """What eval_step may be in ``workdir``, for an error message."""
    intact = integrity.intact_steps(workdir, but)
    if not intact:
        return (f"{workdir / 'checkpoints'} holds no intact step: train there first, or "
                "evaluate another run's workdir")
    return (f"the intact steps in {workdir / 'checkpoints'} are {intact}: give one of them "
            f"(--config.eval_step=N), or leave eval_step unset for the newest ({intact[-1]})")


def _evaluate_init_from(run: run_setup.Run) -> dict[str, float]:
    """``evaluate`` on the weights of ``config.init_from`` (``prepare`` checked that they fill
    the whole model), written as step 0."""
    pipe = run.make_eval_pipeline()     # data errors before the first compile
    processes.check_same_splits({"test": pipe})
    processes.check_same_init_from(run.config.init_from)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings,
                                 run.config.seed)
    state = init_from_lib.load_init_from(state, run.config.init_from, run.shardings,
                                     run.task.patch_grid)
    if run.is_main:
        (run.workdir / "checkpoints").mkdir(parents=True, exist_ok=True)
    params = state.params
    del state   # as in evaluate
    return _evaluate_and_write(run, run.model, params, 0, pipe)


def _evaluate_and_write(run: run_setup.Run, model: Any, params: Any, step: int,
                        pipe: Any) -> dict[str, float]:
    """One pass of ``pipe`` through the eval step of ``model`` with ``params``, written as
    ``step``'s metrics JSON (and predictions, where the task has them)."""
    eval_step = steps_lib.make_eval_step(run.task, model)
    with run.context():
        result = run_evaluation(run, params, eval_step, pipe.iterator,
                                getattr(pipe, "num_batches", None),
                                run.workdir / "predictions" / f"step_{step}{run.eval_tag}")
    path = write_eval(run.workdir, run.config, step, result, run.eval_tag)
    logging.info("eval step %d: %s (written to %s)", step, result, path)
    return {"step": step, "split": evaluated_split(run.config), **result}


def _process_0_choice(workdir: pathlib.Path, step: int | None, steps: list[int]
                      ) -> tuple[int | None, list[int]]:
    """(step, steps) as every process must see them. With several processes, a run saving in
    the workdir can show them different listings (a new latest step, a step rotated out), and
    processes that restored different steps would make one global state of them. Process 0
    decides: its step, added to the others' listing when they miss it (the restore then reads
    it); or, when its check failed, ``step`` removed from theirs, so that every process
    raises."""
    if jax.process_count() == 1:
        return step, steps
    mine = step if step in steps else -1
    chosen = int(multihost_utils.broadcast_one_to_all(np.int32(mine)))
    if chosen < 0:   # process 0 found no step (latest) or not this one
        return step, [] if step is None else [s for s in steps if s != step]
    if chosen != mine:
        logging.warning("process %d: evaluating step %d, process 0's choice (this process "
                        "listed %s in %s)", jax.process_index(), chosen, steps or "none",
                        workdir / "checkpoints")
    return chosen, sorted({*steps, chosen})


def _being_removed(checkpointer: Checkpointer, step: int, keep: int) -> bool:
    """Whether ``step`` is gone, or being removed by a run's ``checkpoint.keep`` (as many
    newer steps as it keeps are there)."""
    steps = integrity.saved_steps(checkpointer.directory.parent)
    return (not (checkpointer.directory / str(step)).exists()
            or 0 < keep <= sum(s > step for s in steps))


def _restore_for_eval(workdir: pathlib.Path, checkpoint: ml_collections.ConfigDict,
                      abstract: state_lib.TrainState, step: int, latest: bool
                      ) -> tuple[state_lib.TrainState, int]:
    """The state at ``step`` of the run in ``workdir`` (``checkpoint``: its config's
    checkpoint settings; ``abstract``: the state's shapes and shardings), or, when eval.py
    evaluates the newest intact step (``latest``), at the newest intact step from ``step`` on
    (``resume.restore_newest_intact``; nothing is moved aside: a run may be training in the
    workdir). A step asked for by number that is
    damaged is one error naming it and the intact steps. A run training in the workdir may
    rotate the step out (checkpoint.keep) while eval.py starts: then the new ``latest`` step
    is read, or, for a step asked for by number, one error says what happened."""
    keep = checkpoint.keep
    checkpointer = Checkpointer(workdir, checkpoint.every_steps, keep, create=False)
    try:
        for _ in range(3):
            try:
                state, step = resume.restore_newest_intact(
                    checkpointer, abstract, None, move=False, start=step, fall_back=latest,
                    gone=lambda s: _being_removed(checkpointer, s, keep))
                return state, step
            except DamagedStep as damage:
                if not _being_removed(checkpointer, damage.step, keep):
                    if latest or damage.reason == "wrong-tree":   # another model: not damage
                        raise
                    raise ValueError(f"eval_step={step}: {resume.damage_only(damage)}; "
                                     f"{_choices(workdir, but=(step,))}") from damage
                if jax.process_count() > 1:   # processes would differ
                    raise
                step = damage.step
                steps = [s for s in integrity.saved_steps(workdir) if s != step]
            if not (latest and steps):
                raise ValueError(
                    f"eval_step={step}: {checkpointer.directory / str(step)} was removed while "
                    "it was read (a run training there keeps only the latest checkpoint.keep "
                    f"steps); evaluate one of {steps} with --config.eval_step=N, or the newest "
                    "with eval_step unset")
            step = steps[-1]
            checkpointer.manager.reload()
        raise ValueError(f"{checkpointer.directory}: the latest step kept changing while it "
                         "was read; try again")
    finally:
        checkpointer.close()


def evaluated_split(config: ml_collections.ConfigDict) -> str:
    """The split evaluation reads: ``config.data.test_split``."""
    return str(config.data.get("test_split", "test"))


def write_eval(workdir: pathlib.Path, config: ml_collections.ConfigDict, step: int,
               result: dict[str, float], tag: str = "") -> pathlib.Path:
    """``result`` as ``step``'s result file in ``workdir`` (``workdir.eval_file``; process 0
    writes it), with the data source ``config`` read when that is not the run's (``tag``:
    ``Run.eval_tag``)."""
    split = evaluated_split(config)
    path = workdir_lib.eval_file(workdir, step, split, tag)
    source = ({"data": workdir_lib.data_source(config_defaults.config_dict(config))}
              if tag else {})
    if jax.process_index() == 0:
        with writing(f"the eval result {path}"):
            workdir_lib.write_json(path, {"step": step, "split": split, **source, **result})
    return path


def read_eval(workdir: pathlib.Path, config: ml_collections.ConfigDict, step: int,
              tag: str = "") -> dict[str, float] | None:
    """The metrics ``write_eval`` saved for ``step`` (None when there is no readable file)."""
    path = workdir_lib.eval_file(workdir, step, evaluated_split(config), tag)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {k: v for k, v in saved.items() if k not in ("step", "split", "data")}
