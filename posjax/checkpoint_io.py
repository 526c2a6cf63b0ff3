"""Reading Orbax checkpoint folders, for the trainer and the weight converter alike: one item
folder (``read_item``, ``read_metadata_tree``) with its failure as one ValueError, and the
echoes of a failed read (asyncio records, callbacks into a closed event loop) dropped
(``failures_reported_once``)."""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import pathlib
import re
import sys
import warnings
from typing import Any, Callable, Iterator, TypeVar

import jax
import orbax.checkpoint as ocp

from posjax.io_utils import error_summary


def root_cause(error: BaseException) -> str:
    """The innermost exception in ``error``'s chain: its type and the first line of its
    message (``error_summary``, shortened by ``short_error``)."""
    while True:
        inner = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if inner is None:
            break
        error = inner
    return short_error(error_summary(error))


def short_error(text: str) -> str:
    """The first line of an error's ``text`` without TensorStore's spec dump, at most 500
    characters."""
    line = (text.strip().splitlines() or [""])[0]
    line = re.sub(r"\s*\[tensorstore_spec(\[\d+\])?='.*$", "", line)
    return line if len(line) <= 500 else line[:497] + "..."


class MentionsPath(logging.Filter):
    """Drops log records whose text names a file under ``path``."""

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.path = str(pathlib.Path(path).expanduser().resolve())   # as TensorStore names it

    def filter(self, record: logging.LogRecord) -> bool:
        return self.path + os.sep not in record.getMessage()


def _is_callback_into_closed_loop(unraisable: Any) -> bool:
    """A TensorStore read finishing after Orbax closed the event loop that awaited it."""
    error, frames = unraisable.exc_value, unraisable.exc_traceback
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        return False
    while frames is not None:
        if frames.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        frames = frames.tb_next
    return False


def drop_closed_loop_callbacks() -> None:
    """Install (once) an unraisable hook that drops ``_is_callback_into_closed_loop``."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_callbacks", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_callback_into_closed_loop(unraisable):
            previous(unraisable)
    hook.drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


@contextlib.contextmanager
def failures_reported_once(path: pathlib.Path) -> Iterator[None]:
    """Around a read of the checkpoint at ``path`` whose failure the caller reports: drop the
    echoes of that failure.

    Orbax awaits all of a checkpoint's array reads at once and closes its event loop when the
    first fails. The other reads of the same damaged files then fail too, each logged by
    asyncio as "exception was never retrieved" (with a multi-kilobyte TensorStore spec) when
    its task is collected, which may be before or after the error reaches the caller; and
    reads still in flight call back into the closed loop ("Event loop is closed", printed as
    an unraisable exception). A damaged checkpoint printed tens of kilobytes of both around
    the one error that names it. Dropped: asyncio records that name ``path`` (from the read
    on; for good once it failed) and callbacks into a closed event loop."""
    echoes = MentionsPath(path)
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addFilter(echoes)
    drop_closed_loop_callbacks()
    try:
        yield
    except Exception:
        with warnings.catch_warnings():   # and reads it never started, as coroutines
            warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
            gc.collect()   # the failed tasks are reported now, while the filter is in place
        raise
    asyncio_log.removeFilter(echoes)


T = TypeVar("T")


def read_metadata_tree(directory: pathlib.Path) -> dict[str, Any]:
    """The saved tree of one Orbax item folder (``read_item``) as metadata: shapes and dtypes,
    no arrays read."""
    meta = read_item(directory, ocp.PyTreeCheckpointHandler(),
                     lambda handler: handler.metadata(directory))
    return dict(getattr(meta, "tree", meta))


def read_item(directory: pathlib.Path, handler: Any, read: Callable[[Any], T]) -> T:
    """``read(handler)`` on one Orbax item folder: a converter's ``params/``, or the ``state``
    item of a train.py step, whose checkpoint-level metadata file is one level up (so a
    Checkpointer would warn that it is missing; the item's handler does not). The handler is
    closed after; a missing or damaged item raises one ValueError naming the folder."""
    try:
        with failures_reported_once(directory):
            return read(handler)
    except Exception as e:   # noqa: BLE001 -- Orbax raises assorted errors for such files
        raise ValueError(f"{directory}: cannot read this checkpoint "
                         f"({root_cause(e)}); if it is damaged (a full disk, "
                         "an interrupted copy), copy or convert it again") from e
    finally:
        handler.close()


def param_differences(state_dir: pathlib.Path, abstract_params: Any) -> list[str]:
    """How the ``params`` tree saved in ``state_dir`` (a step's ``state`` item) differs from
    ``abstract_params`` (anything with shapes): parameters the model has and the checkpoint
    lacks, the reverse, and other shapes, a few names each. Empty when they agree, or when
    the checkpoint's metadata cannot be read (a damaged checkpoint)."""
    try:
        saved = read_metadata_tree(state_dir).get("params")
    except ValueError:   # unreadable metadata: the restore's error says why
        return []
    if not isinstance(saved, dict):
        return []

    def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
        return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
                for path, leaf in leaves[0]}

    ours, theirs = shapes(abstract_params), shapes(saved)
    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
    out = []
    if missing := sorted(set(ours) - set(theirs)):
        out.append(f"not in the checkpoint: {few(missing)}")
    if extra := sorted(set(theirs) - set(ours)):
        out.append(f"not in the model: {few(extra)}")
    if other := [f"{k} {theirs[k]} saved, {ours[k]} in the model"
                 for k in sorted(set(ours) & set(theirs)) if ours[k] != theirs[k]]:
        out.append(f"other shapes: {few(other)}")
    return out


