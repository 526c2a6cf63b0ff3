"""Errors a run ends with, in the user's terms: out of memory (``memory_advice``: what each
device holds and which config keys make it fit) and divergence (``Diverged``: a NaN or inf is
never saved). A lost peer process: ``hosts.peer_lost_message``."""
from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Any, Iterator

import jax
import numpy as np

from posjax import checkpoint_io
from posjax.training import mesh as mesh_lib
from posjax.training import metrics as metrics_lib
from posjax.training import state as state_lib
from posjax.training.checkpointing.checkpointer import Checkpointer

if TYPE_CHECKING:
    from posjax.training import run_setup


@contextlib.contextmanager
def memory_advice(run: run_setup.Run, evaluating: bool = False, holds_state: bool = True
                  ) -> Iterator[None]:
    """XLA's RESOURCE_EXHAUSTED inside the block (device memory; host memory on CPU), raised
    when a program is compiled or run, becomes one ValueError: what each device holds
    (``holds_state``: the train state, else the parameters), and the config keys that make
    training (or ``evaluating``) fit. XLA's whole report (its largest allocations, on GPU and
    TPU) is logged first."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        first = checkpoint_io.short_error(str(e))
        if "RESOURCE_EXHAUSTED" not in first:
            raise
        logging.error("%s", str(e).strip())
        xla = first.replace("RESOURCE_EXHAUSTED: ", "")
        raise ValueError(out_of_memory_message(run, xla, evaluating, holds_state)) from None


def out_of_memory_message(run: run_setup.Run, xla: str, evaluating: bool, holds_state: bool) -> str:
    """The error for a run out of memory (``xla``: XLA's words; see ``memory_advice``)."""
    config, mesh = run.config, run.mesh
    shards = mesh_lib.batch_shards(mesh)
    limit = device_memory_limit()
    params = bytes_per_device(run.abstract.params)
    held, held_name, verb, sharded = (
        (bytes_per_device(run.abstract), "the train state (parameters and optimizer state)",
         "takes", "state") if holds_state else (params, "the parameters", "take", "parameters"))
    sharding = (f"shard the {sharded} over more devices (mesh.fsdp, now {mesh.shape['fsdp']}; "
                f"mesh.tensor, now {mesh.shape['tensor']})")
    if evaluating:
        per_device = (config.eval_batch_size or config.batch_size) // shards
        rest = f"one eval batch's activations ({_examples(per_device)} per device)"
        fixes = [f"lower eval_batch_size (now {config.eval_batch_size}; 0: batch_size, "
                 f"{config.batch_size})"] if per_device > 1 else []
        fix = _alternatives(fixes + [sharding])
    else:
        m = config.microbatches
        per_device = config.batch_size // shards // m
        rest = f"the gradients and one pass's activations ({_examples(per_device)} per device)"
        # The state, the gradients (and their sum over microbatches) whatever the batch.
        fixed = None if held is None or params is None else held + params * (1 + (m > 1))
        if limit and fixed is not None and fixed >= 0.9 * limit:
            fix = (f"with the gradients it (nearly) fills each device ({byte_size(fixed)}) "
                   f"whatever the batch: {sharding}, or train a smaller model")
        else:
            fixes = [f"lower batch_size (now {config.batch_size}) or raise microbatches (now "
                     f"{m}: each step then runs in that many passes over parts of the batch, "
                     "with the same gradients)"] if per_device > 1 else []
            if not getattr(run.task.model_config, "remat", True):
                fixes.append("set model.remat=True (recompute each layer's activations in the "
                             "backward pass)")
            fix = _alternatives(fixes + [sharding])
    if held is None:
        holds = f"Each device holds {held_name} and {rest}."
    else:
        of = f" of the device's {byte_size(limit)}" if limit else ""
        holds = f"Per device {held_name} {verb} {byte_size(held)}{of}; the rest holds {rest}."
    return (f"{'evaluation' if evaluating else 'training'} ran out of memory ({xla}). {holds} "
            f"To fit it: {fix}.")


def state_size_line(run: run_setup.Run) -> str:
    """'N parameters; the train state takes X GiB per device (of the device's Y GiB)'."""
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(run.abstract.params))
    held = bytes_per_device(run.abstract)
    limit = device_memory_limit()
    line = f"{count:,} parameters"
    if held is not None:
        line += f"; the train state takes {byte_size(held)} per device"
        if limit:
            line += f" (of the device's {byte_size(limit)})"
    return line


def _examples(n: int) -> str:
    return f"{n} example{'' if n == 1 else 's'}"


def _alternatives(options: list[str]) -> str:
    """'a', 'a or b', 'a, b, or c'."""
    if len(options) <= 2:
        return " or ".join(options)
    return ", ".join(options[:-1]) + ", or " + options[-1]


def bytes_per_device(abstract: Any, device: Any = None) -> int | None:
    """Bytes of ``abstract``'s (ShapeDtypeStructs with shardings) shards on ``device`` (default
    this process's first); None when a leaf's cannot be told (an extended dtype, an uneven
    sharding)."""
    device = jax.local_devices()[0] if device is None else device
    total = 0
    try:
        for leaf in jax.tree.leaves(abstract):
            size = math.prod(leaf.shape)
            if leaf.sharding is not None:
                index = leaf.sharding.devices_indices_map(leaf.shape)[device]
                size = math.prod(len(range(n)[i]) for i, n in zip(index, leaf.shape))
            total += size * np.dtype(leaf.dtype).itemsize
    except (TypeError, ValueError, KeyError):
        return None
    return total


def device_memory_limit() -> int | None:
    """Bytes the first local device's allocator may use (GPU, TPU); None where the platform
    does not say (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def byte_size(n: float) -> str:
    """``n`` bytes in words: '512 B', '3.5 KiB', '1.03 GiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


class Diverged(RuntimeError):
    """The training loss, gradient norm or weights became NaN or infinite."""


DIVERGENCE_METRICS = ("loss", "grad_norm")


def stop_if_diverged(step: int, accumulator: metrics_lib.MetricAccumulator,
                      state: state_lib.TrainState, checkpointer: Checkpointer,
                      writer: metrics_lib.MetricWriter) -> None:
    """Before a save: raise ``Diverged`` unless the loss and gradient-norm sums of the steps
    since the last log and every value of ``state`` (the weights after this step's update,
    optimizer moments) are finite, so a NaN or inf is never saved and never rotates a good
    checkpoint out. The logs check the sums too (``trainer._Steps``)."""
    if not accumulator.all_finite(DIVERGENCE_METRICS):
        diverged(step, "the loss or gradient norm", checkpointer, writer)
    if not state_lib.all_finite(state):
        diverged(step, "the updated weights or optimizer state", checkpointer, writer)


def diverged(step: int, what: str, checkpointer: Checkpointer,
              writer: metrics_lib.MetricWriter) -> None:
    writer.close()
    checkpointer.wait()
    last = checkpointer.latest_step()
    kept = (f"the checkpoints saved before hold finite values (latest: step {last}, which may "
            "already be on the way to diverging)" if last is not None
            else "no checkpoint was saved")
    raise Diverged(f"training diverged by step {step} ({what} became NaN or infinite); it was "
                   f"stopped before saving that state: {kept}. Lower optimizer.learning_rate, "
                   "raise optimizer.warmup_steps or set optimizer.grad_clip_norm, and start "
                   "again in a new workdir (init_from can start it from a checkpoint)")
