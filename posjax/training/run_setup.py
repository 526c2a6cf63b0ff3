"""Set-up of a run: ``prepare`` checks everything the user can get wrong (config values, mesh
vs devices, batch divisibility, data files and splits, the workdir, init_from) before anything
is compiled or written, and builds the ``Run`` (abstract state only); a resumed run with
another ``num_steps`` keeps its learning-rate schedule (``note_resume``, ``on_resume``:
``optim.resumed_schedule``).
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import optax
from jax.sharding import Mesh

from posjax import config_defaults, storage
from posjax.training import hosts
from posjax.training import init_from_checks
from posjax.training import mesh as mesh_lib
from posjax.training import optim
from posjax.training import processes
from posjax.training import run_config
from posjax.training import state as state_lib
from posjax.training import steps as steps_lib
from posjax.training import workdir as workdir_lib
from posjax.training.checkpointing import integrity
from posjax.training.tasks import Task, make_task


@dataclasses.dataclass
class Run:
    """Everything built from a validated config, before any compilation."""

    config: ml_collections.ConfigDict
    workdir: pathlib.Path
    task: Task
    model: nn.Module
    mesh: Mesh
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    abstract: state_lib.TrainState
    shardings: state_lib.TrainState
    train_step: Any                     # steps.Training.train_step (jitted, not compiled yet)
    evaluates_init_from: bool = False   # eval.py on init_from's weights (``evaluates_init_from``)
    eval_tag: str = ""                  # eval.py on other data than the run's (``eval_tag``)
    data_identity: dict[str, Any] = dataclasses.field(default_factory=dict)   # task's, at set-up

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0

    def context(self):
        """Mesh + logical rules, active while steps are traced and run."""
        return _Context(self.mesh)

    def make_pipeline(self, split: str, global_batch_size: int, train: bool) -> Any:
        """This process's input pipeline: shard k of n, where k is this process's feed of the
        n feeds the mesh asks for (``mesh.batch_feeds``: the rows its devices hold)."""
        shard, count = mesh_lib.process_feed(self.mesh)
        return self.task.make_pipeline(split, global_batch_size // count, self.config.seed,
                                       train, shard, count)

    def make_eval_pipeline(self) -> Any:
        """One pass over ``data.test_split`` in eval batches."""
        return self.make_pipeline("test", self.config.eval_batch_size or self.config.batch_size,
                                  False)


class _Context:
    def __init__(self, mesh: Mesh):
        self._mesh = jax.set_mesh(mesh)
        self._rules = nn.logical_axis_rules(mesh_lib.LOGICAL_RULES)

    def __enter__(self):
        self._mesh.__enter__()
        self._rules.__enter__()

    def __exit__(self, *exc):
        self._rules.__exit__(*exc)
        self._mesh.__exit__(*exc)


def prepare(config: ml_collections.ConfigDict, workdir: str | pathlib.Path,
            training: bool) -> Run:
    """Validate everything and build the run's objects (abstract only: nothing compiled)."""
    workdir = storage.as_path(workdir, "--workdir")
    storage.check_credentials(workdir, "--workdir")
    processes.check_same_software()
    processes.check_same_config(config)   # first: else one process may fail alone on its own config
    task = make_task(config)
    run_config.validate_training_config(config)
    if training and config.get("eval_step") is not None:
        raise ValueError(f"eval_step={config.eval_step!r} applies to eval.py only (the saved "
                         "step it evaluates): train.py evaluates the steps it reaches; leave "
                         "eval_step unset here")
    task.validate()
    mesh = mesh_lib.build_mesh(config.mesh)
    mesh_lib.validate_batch(config, mesh)
    identity = task.data_identity()
    processes.check_same_data_identity(config, identity)
    if not training:   # (train.py checks once it holds the workdir)
        processes.check_shared_workdir(workdir, config_defaults.CONFIG_FILE)
    pretrained = workdir_lib.evaluates_init_from(config, workdir, training)
    extend = config.model.get("extend_positions", "")
    if extend and (training or pretrained):
        what = "train.py trains" if training else "init_from's weights are evaluated"
        raise ValueError(f"model.extend_positions={extend!r} applies only when eval.py "
                         "evaluates a run's checkpoints at a longer data.max_seq_length ("
                         f"{what} with the position table as it is): remove it")
    tag = ""
    if training:
        workdir_lib.check_workdir(workdir, config, identity)
    elif pretrained:
        workdir_lib.check_writable(workdir)
        workdir_lib.check_entries(workdir, workdir_lib.EVAL_ENTRIES)
    elif not (workdir / "checkpoints").is_dir():
        raise ValueError(f"workdir {str(workdir)!r} has no checkpoints/: train there first "
                         "(or give config.init_from to evaluate pretrained weights)")
    else:
        # The metrics JSON goes beside the checkpoint.
        workdir_lib.check_entries(workdir, workdir_lib.EVAL_ENTRIES)
        tag = workdir_lib.eval_tag(workdir_lib.check_eval_config(workdir, config), config)
        # Whatever its path:
        workdir_lib.check_data_identity(workdir, config, identity, training=False)
    training_program = steps_lib.build_training(config, mesh, task)
    abstract, shardings = training_program.abstract, training_program.shardings
    if (training and config.init_from and not integrity.saved_steps(workdir)) or pretrained:
        init_from_checks.check_init_from(config.init_from, abstract.params, task.patch_grid,
                                  task.model_config, whole=pretrained)
        workdir_lib.check_init_from_data(config, identity)
    return Run(config, workdir, task, training_program.model, mesh, training_program.tx,
               training_program.schedule, abstract, shardings, training_program.train_step,
               pretrained, tag, identity)


def note_resume(workdir: pathlib.Path, saved: dict[str, Any] | None,
                config: ml_collections.ConfigDict, changes: list[str]) -> None:
    """Process 0, before a resumed run replaces its ``config.json`` (``saved``): log the keys
    that change (``changes``) and record the schedule so far when ``num_steps`` changes it
    (``optim.record_original``)."""
    if not saved or not changes:
        return
    print("resumed with a changed config (config.json updated): " + "; ".join(changes),
          flush=True)
    if isinstance(saved.get("num_steps"), int):
        optim.record_original(workdir, saved["num_steps"], int(config.num_steps),
                              config.optimizer)


def on_resume(run: Run, start: int) -> Run:
    """``run`` with the optimizer and schedule of a run resumed at ``start``
    (``optim.resumed_schedule``); the segments recorded by process 0. Every process calls
    it."""
    recorded = hosts.gather(optim.read_segments(run.workdir) if run.is_main else None)[0]
    if start == 0:   # a fresh start: the config's schedule, and no record of another run
        if run.is_main:
            (run.workdir / optim.SCHEDULE_FILE).unlink(missing_ok=True)
        return run
    config = run.config
    schedule, segments = optim.resumed_schedule(run.workdir, config.optimizer, start,
                                                config.num_steps, recorded)
    if schedule is None:
        return run
    if run.is_main and segments != recorded:
        optim.write_segments(run.workdir, segments)
    program = steps_lib.build_training(config, run.mesh, run.task, schedule)
    return dataclasses.replace(run, tx=program.tx, schedule=program.schedule,
                               train_step=program.train_step)
