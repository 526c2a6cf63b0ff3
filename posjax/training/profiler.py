"""A device profile of some training steps: ``config.profile`` = {first_step, num_steps}.

Steps ``first_step`` … ``first_step + num_steps − 1`` (numbered as the progress lines number
them; step 1 includes the compilation) are traced with ``jax.profiler`` by process 0 into
``<workdir>/tensorboard``, beside the scalars: TensorBoard's Profile tab shows them (with the
``tensorboard-plugin-profile`` package), and the ``*.trace.json.gz`` file in
``plugins/profile/<time>/`` opens in Perfetto (ui.perfetto.dev). The trace ends once the last
traced step's results are ready, so it holds that step's device work; a run that ends or stops
sooner ends it there.
"""
from __future__ import annotations

import logging
import pathlib
from typing import Any

import jax
import ml_collections

DIRECTORY = "tensorboard"


def validate(profile: ml_collections.ConfigDict, num_steps: int) -> None:
    """``profile.first_step`` ≥ 1 within the run, ``profile.num_steps`` ≥ 0 (0: no profile)."""
    first, count = profile.first_step, profile.num_steps
    if not (isinstance(count, int) and count >= 0):
        raise ValueError(f"profile.num_steps={count!r} is not valid: must be an integer >= 0 "
                         "(0: no profile)")
    if count and not (isinstance(first, int) and 1 <= first <= num_steps):
        raise ValueError(f"profile.first_step={first!r} is not valid: must be a step of the run, "
                         f"1 … num_steps={num_steps} (1 includes the compilation)")


class StepProfile:
    """Traces the configured steps: call ``before(step)`` before a step runs (``step`` = its
    number), ``after(step, outputs)`` once it is dispatched, and ``close()`` at the end."""

    def __init__(self, profile: ml_collections.ConfigDict, workdir: pathlib.Path, start: int,
                 enabled: bool = True):
        self.first, self.count = profile.first_step, profile.num_steps
        self.last = self.first + self.count - 1
        self.directory = pathlib.Path(workdir) / DIRECTORY
        self.enabled = enabled and self.count > 0
        self.active = False
        self.traced = start
        if self.enabled and start >= self.first:
            logging.warning("profile: steps %d-%d are not traced, this run starts after step "
                            "%d (set profile.first_step to a later step)", self.first,
                            self.last, start)
            self.enabled = False

    def before(self, step: int) -> None:
        if self.enabled and step == self.first:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, outputs: Any) -> str | None:
        """The line to print once the trace is written (after the last traced step)."""
        if not self.active:
            return None
        self.traced = step
        if step < self.last:
            return None
        return self.close(outputs)

    def close(self, outputs: Any = None) -> str | None:
        """End the trace once ``outputs`` (the last traced step's) are ready; the line to print
        (None when nothing was traced)."""
        if not self.active:
            return None
        try:
            jax.block_until_ready(outputs)
        except Exception:   # noqa: BLE001 (a step that failed: its error is the one raised)
            pass
        jax.profiler.stop_trace()
        self.active = self.enabled = False
        return (f"profile of steps {self.first}-{self.traced} written to "
                f"{self.directory / 'plugins' / 'profile'} (TensorBoard's Profile tab; its "
                "*.trace.json.gz opens in Perfetto)")
