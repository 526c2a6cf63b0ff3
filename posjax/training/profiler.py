"""A device profile of some training steps: ``config.profile`` = {first_step, num_steps}.

Steps ``first_step`` … ``first_step + num_steps − 1`` (numbered as the progress lines number
them; the first step a run or a resumed run takes includes the compilation) are traced with
``jax.profiler`` by process 0 into ``<workdir>/tensorboard``, beside the scalars: TensorBoard's
Profile tab shows them (with the ``tensorboard-plugin-profile`` package), and the
``*.trace.json.gz`` file in ``plugins/profile/<time>/`` opens in Perfetto (ui.perfetto.dev).
The trace ends once the last traced step's results are ready, or where the run stops or fails
within the traced steps. A profile that cannot be started or written is a warning: it never
ends the run.
"""
from __future__ import annotations

import logging
import pathlib
from typing import Any

import jax
import ml_collections

from posjax import storage

DIRECTORY = "tensorboard"


def validate(profile: ml_collections.ConfigDict, num_steps: int) -> None:
    """``profile.num_steps`` ≥ 0 (0: no profile); the traced steps within 1 … ``num_steps``."""
    first, count = profile.first_step, profile.num_steps
    if not (type(count) is int and count >= 0):
        raise ValueError(f"profile.num_steps={count!r} is not valid: must be an integer >= 0 "
                         "(0: no profile)")
    if count and not (type(first) is int and 1 <= first and first + count - 1 <= num_steps):
        raise ValueError(f"profile.first_step={first!r} is not valid with profile.num_steps="
                         f"{count}: the traced steps must be steps of the run, 1 … num_steps="
                         f"{num_steps}")


class StepProfile:
    """Traces the configured steps: ``before(step)`` before a step runs (``step`` = its
    number), ``last_step(step)`` after it, then ``close(outputs)`` ends the trace once the
    step's ``outputs`` are ready (also where the run stops or fails; a no-op when no trace
    is running)."""

    def __init__(self, profile: ml_collections.ConfigDict, workdir: pathlib.Path, start: int,
                 enabled: bool = True):
        self.first, self.count = profile.first_step, profile.num_steps
        self.last = self.first + self.count - 1
        self.directory = storage.path(workdir) / DIRECTORY
        self.enabled = enabled and self.count > 0
        self.active = False
        self.traced = start
        if self.enabled and start >= self.first:
            logging.warning("profile: steps %d-%d are not traced, this run starts after step "
                            "%d (set profile.first_step to a later step)", self.first,
                            self.last, start)
            self.enabled = False

    def before(self, step: int) -> None:
        if not (self.enabled and step == self.first):
            return
        self.enabled = False   # one trace per run
        try:
            jax.profiler.start_trace(str(self.directory))
        except Exception as e:   # noqa: BLE001 (diagnostics: never the end of a run)
            logging.warning("profile: the trace could not be started (%s); training goes on", e)
            return
        self.active = True

    def last_step(self, step: int) -> bool:
        """Whether ``step`` (just run) is the last traced one."""
        if self.active:
            self.traced = step
        return self.active and step >= self.last

    def close(self, outputs: Any = None) -> str | None:
        """End the trace once ``outputs`` are ready; the line to print (None when no trace was
        running or it could not be written)."""
        if not self.active:
            return None
        self.active = False
        try:
            jax.block_until_ready(outputs)
        except Exception:   # noqa: BLE001 (a step that failed: its error is the one raised)
            pass
        try:
            jax.profiler.stop_trace()
        except Exception as e:   # noqa: BLE001 (diagnostics: never the end of a run)
            logging.warning("profile: the trace of steps %d-%d could not be written in %s (%s)",
                            self.first, self.traced, self.directory, e)
            return None
        return (f"profile of steps {self.first}-{self.traced} written to "
                f"{self.directory / 'plugins' / 'profile'} (TensorBoard's Profile tab; its "
                "*.trace.json.gz opens in Perfetto)")
