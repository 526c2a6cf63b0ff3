"""Elastic resume: the input position of a step saved by another number of processes.

Every posjax training pipeline reads one global stream whose global batches do not depend on
the process count (``posjax.data``: process ``i`` of ``n`` keeps rows [i·b, (i+1)·b) of each
global batch), so the iterator state each process saves is one global position, the same on
every process: images, GLUE and the synthetic tasks save the global batch index (global batch
t is examples [t·B, (t+1)·B) of the stream, B = ``batch_size``), text saves its place in the
document stream and the global count of sequences packed. A step saved by N processes
therefore resumes on N' processes with that one position on every process, and the run sees
each example once per epoch, in the order of an uninterrupted run. What would lose or repeat
data (another ``batch_size``, ``seed`` or ``data.*``) is refused earlier, by the config
comparison (``run_config.config_differences``); so is ``data.worker_count`` (Grain saves
another state with worker processes).
"""
from __future__ import annotations

import logging
import pathlib


def saved_by_others(step_dir: pathlib.Path, process_count: int) -> str | None:
    """The saved input position (Grain's JSON) when ``step_dir`` was saved by another number of
    processes than ``process_count``; None when by this number, or when its files are not one
    per saving process (Orbax's own restore then reports the missing file).

    Raises ValueError when the saved processes' positions differ (a pipeline whose position
    is per process cannot move to another process count)."""
    files = sorted(step_dir.joinpath("data_iter").glob("process_*-of-*.json"))
    counts = {int(f.stem.rsplit("-of-", 1)[-1]) for f in files}
    if len(counts) != 1 or counts == {process_count} or len(files) != min(counts):
        return None
    saved = counts.pop()
    positions = {f.read_text() for f in files}
    if len(positions) != 1:
        raise ValueError(
            f"checkpoint {step_dir} holds a different input position for each of the {saved} "
            f"processes that saved it, not one global position: resume it with {saved} "
            f"processes (this run has {process_count})")
    logging.info("checkpoint %s was saved by %d process(es), this run has %d: every process "
                 "resumes at the one global input position saved", step_dir, saved,
                 process_count)
    return positions.pop()
