"""Training: ``train(config, workdir)``, in phases:

1. validate (``run_setup.prepare``; data errors of both splits before anything is written),
2. lock the workdir (``checkpointing.lock``), check it again and save the run's config,
3. init or resume (the newest intact checkpoint: ``checkpointing.resume``, else fresh
   parameters, maybe ``init_from``'s),
4. the steps: each step, log every ``log_every_steps``, save when due, evaluate every
   ``eval_every_steps``, stop after a preemption (SIGTERM) once the step is saved,
5. final evaluation, written beside the last checkpoint.

Several processes: each feeds the rows of every global batch its devices hold
(``mesh.batch_feeds``);
a SIGTERM reaches ``Checkpointer.reached_preemption``, and every process stops
after the same step, saves it and returns ``preempted=True``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from posjax import config_defaults
from posjax.io_utils import signals_to_receiver_thread, writing
from posjax.training import errors
from posjax.training import evaluator
from posjax.training import hosts
from posjax.training import init_from as init_from_lib
from posjax.training import mesh as mesh_lib
from posjax.training import metrics as metrics_lib
from posjax.training import peak_flops
from posjax.training import processes
from posjax.training import profiler
from posjax.training import run_setup
from posjax.training import state as state_lib
from posjax.training import steps as steps_lib
from posjax.training import stop_request
from posjax.training import workdir as workdir_lib
from posjax.training.checkpointing import integrity, lock, resume
from posjax.training.checkpointing.checkpointer import Checkpointer


@dataclasses.dataclass
class TrainResult:
    step: int                      # last step reached
    preempted: bool                # stopped by SIGTERM (or stop_after), after saving
    eval: dict[str, float]         # final eval metrics (empty when preempted)
    start: int                     # the step this run started from (= step: stopped in set-up)

    def stop_line(self) -> str | None:
        """What train.py prints when the run stopped before num_steps (None if it did not)."""
        if not self.preempted:
            return None
        if self.step != self.start:
            return f"preempted: checkpoint saved at step {self.step}; rerun to resume"
        rerun = f"rerun to resume from step {self.step}" if self.step else "rerun to start"
        return f"stopped before the first step of this run: nothing new to save; {rerun}"


@signals_to_receiver_thread()   # input workers never die of a group SIGTERM
def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path,
          stop_after: int | None = None) -> TrainResult:
    """Train to ``config.num_steps`` (resuming from the latest checkpoint in ``workdir``).

    ``stop_after``: stop (with a saved checkpoint) once this step is reached, as a preemption
    would; used to test resumption.
    """
    with contextlib.ExitStack() as stack:
        # From the start: a SIGTERM during set-up is no crash.
        stop = stack.enter_context(stop_request.StopRequest(config.get("preemption")))
        run, pipe, test = _validate(config, workdir)
        # Closing stops the input workers and frees the batches they had prefetched.
        iterator = stack.enter_context(contextlib.closing(pipe.iterator))
        if stop.requested:   # before anything is written
            return _stopped_in_set_up(run.workdir)
        run.workdir.mkdir(parents=True, exist_ok=True)
        stack.enter_context(lock.exclusive(run.workdir, run.is_main))   # one run per workdir
        _check_again_and_save_config(run.workdir, config, run.data_identity)
        checkpointer = stack.enter_context(contextlib.closing(Checkpointer(
            run.workdir, config.checkpoint.every_steps, config.checkpoint.keep,
            config.checkpoint.async_save, stop=stop)))
        stack.enter_context(errors.memory_advice(run))
        state, start = _init_or_resume(run, checkpointer, iterator)
        run = run_setup.on_resume(run, start)   # another num_steps: lr continues
        if stop.begin_steps():   # nothing new to save
            return _stopped_in_set_up(run.workdir)
        evaluate = _evaluation(run, test)
        writer = stack.enter_context(metrics_lib.MetricWriter(run.workdir, run.is_main, start))
        steps = _Steps(run, state, start, iterator, checkpointer, writer, evaluate)
        del state   # the steps carry it on: no reference here keeps its buffers alive
        stack.enter_context(run.context())
        stack.callback(steps.end_profile)   # a run that fails within the traced steps
        if steps.take(stop_after):   # preempted, the step saved: train.py says so
            return TrainResult(steps.step, True, {}, start)
        result = _final_evaluation(run.workdir, config, steps.state.params, steps.step, start,
                                   writer, evaluate)
        return TrainResult(steps.step, False, result, start)


def _validate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path
              ) -> tuple[run_setup.Run, Any, Any]:
    """Phase 1: (run, train pipeline, test pipeline), every check made before anything is
    written: ``run_setup.prepare``'s, then the data errors (and data that does not fit the
    model) of both splits, the test split's too (else they would end the run at its first
    evaluation). The test split is read once: each evaluation is a fresh pass over its
    dataset."""
    run = run_setup.prepare(config, workdir, training=True)
    test = run.make_eval_pipeline()
    test.iterator.close()
    pipe = run.make_pipeline("train", config.batch_size, True)
    processes.check_same_splits({"train": pipe, "test": test})
    return run, pipe, test


def _stopped_in_set_up(workdir: pathlib.Path) -> TrainResult:
    """A stop requested before the first step of this run: nothing new to save."""
    steps = integrity.saved_steps(workdir)
    last = steps[-1] if steps else 0
    return TrainResult(last, True, {}, last)


def _check_again_and_save_config(workdir: pathlib.Path, config: ml_collections.ConfigDict,
                                 data_identity: dict[str, Any]) -> None:
    """Phase 2, the workdir locked: check it again (another run may have ended meanwhile),
    then process 0 notes a resume's config changes and saves the config and data identity."""
    processes.check_shared_workdir(workdir)
    if jax.process_index() != 0:
        return
    workdir_lib.check_workdir(workdir, config, data_identity)
    saved = (config_defaults.read_saved_config(workdir)
             if integrity.saved_steps(workdir) else None)
    run_setup.note_resume(workdir, saved, config,
                          workdir_lib.resume_changes(saved, config) if saved else [])
    workdir_lib.write_json(workdir / config_defaults.CONFIG_FILE,
                           workdir_lib.config_to_save(workdir, config))
    workdir_lib.write_data_identity(workdir, data_identity)


def _init_or_resume(run: run_setup.Run, checkpointer: Checkpointer, iterator: Any
                    ) -> tuple[state_lib.TrainState, int]:
    """Phase 3: (state, its step): the newest intact checkpoint's (``iterator`` set to its
    position), else fresh parameters, ``config.init_from``'s where given, at step 0."""
    if (found := resume.restore_newest_intact(checkpointer, run.abstract, iterator)):
        state, latest = found
        hosts.print_main(f"resuming from {checkpointer.directory / str(latest)}")
        return state, latest
    init_from = run.config.init_from
    if init_from:
        processes.check_same_init_from(init_from)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings,
                                 run.config.seed)
    if init_from:
        state = init_from_lib.load_init_from(state, init_from, run.shardings,
                                             run.task.patch_grid)
        hosts.print_main(f"parameters initialised from {init_from}")
    return state, 0


def _evaluation(run: run_setup.Run, test: Any) -> Callable[[Any], dict[str, float]]:
    """``evaluate(params)``: one fresh pass over the test split (``test``'s dataset), the train
    state on the devices beside it."""
    eval_step = steps_lib.make_eval_step(run.task, run.model)
    num_batches = getattr(test, "num_batches", None)
    return lambda params: evaluator.run_evaluation(run, params, eval_step, iter(test.dataset),
                                                   num_batches, holds_state=True)


class _Steps:
    """Phase 4, the steps from ``start`` to ``config.num_steps`` (``take``); ``state`` and
    ``step`` are where they have got to. Set up here: the metric accumulator, the progress
    line (and its MFU: the FLOPs and state size are printed first), the step profile."""

    def __init__(self, run: run_setup.Run, state: state_lib.TrainState, start: int,
                 iterator: Any, checkpointer: Checkpointer, writer: metrics_lib.MetricWriter,
                 evaluate: Callable[[Any], dict[str, float]]) -> None:
        config = run.config
        self.state, self.step, self.start = state, start, start
        self.iterator, self.checkpointer, self.writer = iterator, checkpointer, writer
        self.evaluate = evaluate
        self.train_step = run.train_step   # steps.build_training: what the plan command compiles
        self.mesh, self.schedule = run.mesh, run.schedule
        self.num_steps, self.batch_size = config.num_steps, config.batch_size
        self.log_every, self.eval_every = config.log_every_steps, config.eval_every_steps
        self.progress = metrics_lib.Progress(self.num_steps, start)
        self.accumulator = metrics_lib.MetricAccumulator()
        self.step_flops = run.task.train_flops().total(self.batch_size)
        self.peak = peak_flops.peak_flops_per_device(config.peak_flops)
        hosts.print_main(f"{self.step_flops:.4g} train FLOPs/step; MFU against "
                         f"{self.peak.value:.4g} FLOP/s per device ({self.peak.source}) x "
                         f"{jax.device_count()} devices")
        hosts.print_main(errors.state_size_line(run))
        # The steps' randomness; the init used the plain seed.
        self.key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
        self.started = time.perf_counter()
        self.profile = profiler.StepProfile(config.profile, run.workdir, start, run.is_main)

    def take(self, stop_after: int | None) -> bool:
        """The steps, each logged every ``log_every_steps``, saved when due, evaluated every
        ``eval_every_steps``; the last one saved. Whether a preemption (or ``stop_after``)
        stopped them."""
        preempted = False
        while self.step < self.num_steps:
            self._train_step()
            step = self.step
            self.checkpointer.check_background_save(step % self.log_every == 0)
            if step == self.start + 1:   # exclude compilation from throughput
                self._first_step_done()
            if step % self.log_every == 0 or step == self.num_steps:
                self._log()
            if self.profile.last_step(step):
                self.end_profile()
            self._save()   # before a periodic eval: a stop during the eval then loses nothing
            if self.eval_every and step % self.eval_every == 0 and step != self.num_steps:
                self._evaluate()
            if self.checkpointer.reached_preemption(step) or step == stop_after:
                self.end_profile()   # stopped within the traced steps: not its save
                preempted = True
                break
        if self.checkpointer.latest_step() != self.step:
            self._save(force=True)
        self.checkpointer.wait()
        return preempted

    def _train_step(self) -> None:
        asked = time.perf_counter()
        batch = mesh_lib.global_batch(next(self.iterator), self.mesh)
        self.progress.input_wait += time.perf_counter() - asked
        self.profile.before(self.step + 1)
        self.state, step_metrics = self.train_step(self.state, batch, self.key)
        self.step += 1
        self.accumulator.add(step_metrics)

    def _first_step_done(self) -> None:
        """Print the first step's time (its compilation included); time the rest from here."""
        jax.block_until_ready(self.state.step)
        hosts.print_main(f"step {self.step} (compilation included) took "
                         f"{time.perf_counter() - self.started:.1f}s")
        self.progress.restart(self.step)

    def _save(self, force: bool = False) -> None:
        """Save ``state`` at ``step`` when due (or ``force``), never a diverged one."""
        if force or self.checkpointer.due(self.step):
            errors.stop_if_diverged(self.step, self.accumulator, self.state, self.checkpointer,
                                    self.writer)
        self.checkpointer.save(self.step, self.state, self.iterator, force=force)

    def _log(self) -> None:
        """The train metrics since the last log, written and printed; then a NaN or inf among
        them stops the run."""
        step = self.step
        finite = self.accumulator.all_finite(errors.DIVERGENCE_METRICS)
        scalars = self.accumulator.result()
        steps_per_s, elapsed, input_wait = self.progress.rate(step)
        scalars["lr"] = float(self.schedule(step - 1))
        if np.isfinite(steps_per_s):   # not on the first log after (re)compilation
            scalars.update({
                "steps_per_s": steps_per_s,
                "examples_per_s": steps_per_s * self.batch_size,
                "mfu": self.peak.mfu(self.step_flops * steps_per_s / jax.device_count()),
                # Near 1: the input pipeline, not the devices, sets the step rate.
                "input_wait_share": min(input_wait / elapsed, 1.0),
            })
        self.writer.write(step, "train", scalars)
        hosts.print_main(self.progress.line(step, scalars, steps_per_s))
        if not finite:
            errors.diverged(step, "the loss or gradient norm", self.checkpointer, self.writer)

    def _evaluate(self) -> None:
        result = self.evaluate(self.state.params)
        self.writer.write(self.step, "eval", result)
        hosts.print_main(f"eval at step {self.step}: {_format(result)}")

    def end_profile(self) -> None:
        """End the profile's trace, if one is running, once ``state`` is ready."""
        if (line := self.profile.close(self.state)) is not None:
            hosts.print_main(line)
            self.progress.restart(self.step)   # writing the trace is no step time


def _final_evaluation(workdir: pathlib.Path, config: ml_collections.ConfigDict, params: Any,
                      step: int, start: int, writer: metrics_lib.MetricWriter,
                      evaluate: Callable[[Any], dict[str, float]]) -> dict[str, float]:
    """Phase 5: ``params`` (the last step's, saved) evaluated, or, for a finished run rerun,
    the result it wrote; logged, written beside the last checkpoint, and the loss curve."""
    result = evaluator.read_eval(workdir, config, step) if start == step else None
    if result is None:
        result = evaluate(params)
    writer.write_once(step, "eval", result)
    writer.close()
    path = evaluator.write_eval(workdir, config, step, result)
    if jax.process_index() == 0:
        with writing(f"the loss curve {workdir / 'loss_curve.png'}"):
            metrics_lib.plot_curves(workdir)
    hosts.print_main(f"final eval at step {step}: {_format(result)}  ({path})")
    return result


def _format(result: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in result.items())
