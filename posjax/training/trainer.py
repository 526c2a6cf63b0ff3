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
from typing import Any, Iterable

import jax
import ml_collections
import numpy as np

from posjax import config_defaults
from posjax.io_utils import signals_to_receiver_thread, writing
from posjax.training import errors
from posjax.training import evaluator
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
    with stop_request.StopRequest() as stop:   # from the start: a SIGTERM during set-up is no crash
        run = run_setup.prepare(config, workdir, training=True)
        # Data errors (and data that does not fit the model) before anything is written, in
        # the test split too (else they would end the run at its first evaluation). The test
        # split is read once: each evaluation is a fresh pass over its dataset.
        test = run.make_eval_pipeline()
        test.iterator.close()
        pipe = run.make_pipeline("train", config.batch_size, True)
        processes.check_same_splits({"train": pipe, "test": test})
        # Closing stops the input workers and frees the batches they had prefetched.
        with contextlib.closing(pipe.iterator):
            if stop.requested:   # before anything is written
                return _stopped_in_set_up(run)
            run.workdir.mkdir(parents=True, exist_ok=True)
            with lock.exclusive(run.workdir, run.is_main):   # one run per workdir
                processes.check_shared_workdir(run.workdir)
                if run.is_main:
                    # Again: another run may have ended.
                    workdir_lib.check_workdir(run.workdir, config, run.data_identity)
                    saved = (config_defaults.read_saved_config(run.workdir)
                             if integrity.saved_steps(run.workdir) else None)
                    run_setup.note_resume(
                        run.workdir, saved, config,
                        workdir_lib.resume_changes(saved, config) if saved else [])
                    workdir_lib.write_json(run.workdir / config_defaults.CONFIG_FILE,
                                           workdir_lib.config_to_save(run.workdir, config))
                    workdir_lib.write_data_identity(run.workdir, run.data_identity)
                checkpointer = Checkpointer(
                    run.workdir, config.checkpoint.every_steps, config.checkpoint.keep,
                    config.checkpoint.async_save, stop=stop)
                try:
                    with errors.memory_advice(run):
                        return _train(run, checkpointer, pipe.iterator, test.dataset,
                                      getattr(test, "num_batches", None), stop_after)
                finally:
                    checkpointer.close()


def _stopped_in_set_up(run: run_setup.Run) -> TrainResult:
    """A stop requested before the first step of this run: nothing new to save."""
    steps = integrity.saved_steps(run.workdir)
    last = steps[-1] if steps else 0
    return TrainResult(last, True, {}, last)


def _start_state(run: run_setup.Run, checkpointer: Checkpointer, iterator: Any
                 ) -> tuple[state_lib.TrainState, int]:
    if (found := resume.restore_newest_intact(checkpointer, run.abstract, iterator)):
        state, latest = found
        run_setup.print_main(run, f"resuming from {checkpointer.directory / str(latest)}")
        return state, latest
    if run.config.init_from:
        processes.check_same_init_from(run.config.init_from)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings,
                                 run.config.seed)
    if run.config.init_from:
        state = init_from_lib.load_init_from(state, run.config.init_from, run.shardings,
                                         run.task.patch_grid)
        run_setup.print_main(run, f"parameters initialised from {run.config.init_from}")
    return state, 0


def _train(run: run_setup.Run, checkpointer: Checkpointer, iterator: Any,
           test: Iterable[dict[str, np.ndarray]], test_batches: int | None,
           stop_after: int | None) -> TrainResult:
    config, task = run.config, run.task
    num_steps = config.num_steps
    state, start = _start_state(run, checkpointer, iterator)
    run = run_setup.on_resume(run, start)   # another num_steps: lr continues
    if checkpointer.stop and checkpointer.stop.begin_steps():   # nothing new to save
        return _stopped_in_set_up(run)
    train_step = run.train_step   # steps.build_training: what the plan command compiles
    eval_step = steps_lib.make_eval_step(task, run.model)
    writer = metrics_lib.MetricWriter(run.workdir, run.is_main, start)
    progress = metrics_lib.Progress(num_steps, start)
    accumulator = metrics_lib.MetricAccumulator()
    step_flops = task.train_flops().total(config.batch_size)
    peak = peak_flops.peak_flops_per_device(config.peak_flops)
    run_setup.print_main(run, f"{step_flops:.4g} train FLOPs/step; MFU against "
                              f"{peak.value:.4g} FLOP/s per "
                f"device ({peak.source}) x {jax.device_count()} devices")
    run_setup.print_main(run, errors.state_size_line(run))
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)   # init used the plain seed
    preempted = False
    step = start
    first = True
    started = time.perf_counter()

    def save(force: bool = False) -> None:
        """Save ``state`` at ``step`` when due (or ``force``), never a diverged one."""
        if force or checkpointer.due(step):
            errors.stop_if_diverged(step, accumulator, state, checkpointer, writer)
        checkpointer.save(step, state, iterator, force=force)

    profile = profiler.StepProfile(config.profile, run.workdir, start, run.is_main)

    def end_profile() -> None:
        if (line := profile.close(state)) is not None:
            run_setup.print_main(run, line)
            progress.restart(step)   # writing the trace is no step time

    with run.context(), contextlib.ExitStack() as stack:
        stack.callback(end_profile)   # a run that fails within the traced steps
        while step < num_steps:
            asked = time.perf_counter()
            batch = mesh_lib.global_batch(next(iterator), run.mesh)
            progress.input_wait += time.perf_counter() - asked
            profile.before(step + 1)
            state, step_metrics = train_step(state, batch, key)
            step += 1
            accumulator.add(step_metrics)
            checkpointer.check_background_save(step % config.log_every_steps == 0)
            if first:   # exclude compilation from throughput
                jax.block_until_ready(state.step)
                run_setup.print_main(run, f"step {step} (compilation included) took "
                            f"{time.perf_counter() - started:.1f}s")
                progress.restart(step)
                first = False
            if step % config.log_every_steps == 0 or step == num_steps:
                finite = accumulator.all_finite(errors.DIVERGENCE_METRICS)
                _log_train(run, step, accumulator, progress, writer, step_flops, peak)
                if not finite:
                    errors.diverged(step, "the loss or gradient norm", checkpointer, writer)
            if profile.last_step(step):
                end_profile()
            save()   # before a periodic eval: a stop during the eval then loses nothing
            if config.eval_every_steps and step % config.eval_every_steps == 0 \
                    and step != num_steps:
                result = evaluator.run_evaluation(run, state.params, eval_step, iter(test),
                                        test_batches, holds_state=True)
                writer.write(step, "eval", result)
                run_setup.print_main(run, f"eval at step {step}: {_format(result)}")
            if checkpointer.reached_preemption(step) or step == stop_after:
                end_profile()   # stopped within the traced steps: not its save
                if checkpointer.latest_step() != step:
                    save(force=True)
                checkpointer.wait()
                preempted = True
                break
        if preempted:   # train.py says so
            writer.close()
            return TrainResult(step, True, {}, start)
        if checkpointer.latest_step() != step:
            save(force=True)
        checkpointer.wait()
        result = evaluator.read_eval(run, step) if start == step else None   # a finished run rerun
        if result is None:
            result = evaluator.run_evaluation(run, state.params, eval_step, iter(test),
                                              test_batches,
                                    holds_state=True)
        writer.write_once(step, "eval", result)
    writer.close()
    path = evaluator.write_eval(run, step, result)
    if run.is_main:
        with writing(f"the loss curve {run.workdir / 'loss_curve.png'}"):
            metrics_lib.plot_curves(run.workdir)
    run_setup.print_main(run, f"final eval at step {step}: {_format(result)}  ({path})")
    return TrainResult(step, False, result, start)


def _log_train(run: run_setup.Run, step: int, accumulator: metrics_lib.MetricAccumulator,
               progress: metrics_lib.Progress, writer: metrics_lib.MetricWriter,
               step_flops: float, peak: peak_flops.PeakFlops) -> None:
    scalars = accumulator.result()
    steps_per_s, elapsed, input_wait = progress.rate(step)
    examples_per_s = steps_per_s * run.config.batch_size
    scalars["lr"] = float(run.schedule(step - 1))
    if np.isfinite(steps_per_s):   # not on the first log after (re)compilation
        scalars.update({
            "steps_per_s": steps_per_s,
            "examples_per_s": examples_per_s,
            "mfu": peak.mfu(step_flops * steps_per_s / jax.device_count()),
            # Near 1: the input pipeline, not the devices, sets the step rate.
            "input_wait_share": min(input_wait / elapsed, 1.0),
        })
    writer.write(step, "train", scalars)
    run_setup.print_main(run, progress.line(step, scalars, steps_per_s))


def _format(result: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in result.items())
