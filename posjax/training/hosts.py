"""The processes of a run as one group: JAX's distributed start
(``maybe_initialize_distributed``), values exchanged between them (``several``, ``gather``,
``process_0_view``), a line printed by process 0 (``print_main``) and the one line for a peer
process that is gone (``peer_lost_message``).

The floor of ``posjax.training``: it imports no other training module, so any of them may use
it (what the processes must agree on is checked in ``processes``).
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from posjax import checkpoint_io


def maybe_initialize_distributed(config: ml_collections.ConfigDict) -> None:
    """jax.distributed.initialize when ``config.distributed.enabled`` (before any device use).
    Empty address / 0 processes / -1 id: auto-detected (TPU pods, SLURM, ...)."""
    d = config.distributed
    if not d.enabled:
        return
    kwargs = {}
    if d.coordinator_address:
        kwargs["coordinator_address"] = d.coordinator_address
    if d.num_processes > 0:
        kwargs["num_processes"] = int(d.num_processes)
    if d.process_id >= 0:
        kwargs["process_id"] = int(d.process_id)
    timeout = d.get("peer_timeout_s", 120)
    if not (isinstance(timeout, (int, float)) and 1 <= timeout < 86400):
        raise ValueError(f"distributed.peer_timeout_s={timeout!r} is not valid: give the "
                         "seconds (at least 1, e.g. 120) after which a silent process counts "
                         "as lost and every process stops")
    # A process whose heartbeats stop for this long (dead host, hung or stopped process) is
    # declared lost by JAX's coordination service, which then ends every other process.
    jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=max(int(timeout), 1))


def several() -> bool:
    """Whether this run has more than one process (else there is nothing to compare)."""
    return jax.process_count() > 1


def gather(value: Any) -> list[Any]:
    """``value`` (JSON-serialisable) of every process, in process order; ``[value]`` with one
    process. A collective: every process must call it, with its own value."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value, sort_keys=True).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, sizes)]


def print_main(line: str) -> None:
    """Print ``line`` (flushed) on process 0 only."""
    if jax.process_index() == 0:
        print(line, flush=True)


def process_0_view(check: Callable[[], Any]) -> Any:
    """``check()`` as process 0 sees it, on every process (one reads the files, the others
    take its answer: a collective with several processes)."""
    found = check() if jax.process_index() == 0 else None
    return gather(found)[0] if several() else found


# How a collective or the coordination service words a process that is gone (its TCP
# connections reset, its heartbeats stopped).
_PEER_LOST = re.compile(r"Gloo [\w-]+ failed|Connection (reset|closed) by peer|Socket closed|"
                        r"missing heartbeats|heartbeat timeout|tasks? (has |have )?"
                        r"(died|disconnected|unhealthy)|DEADLINE_EXCEEDED: Barrier", re.I)


def peer_lost_message(error: BaseException) -> str | None:
    """One line for an error that says another process of the run is gone (killed, its host
    lost); None for any other error."""
    seen = error
    while seen is not None:
        text = str(seen)
        if _PEER_LOST.search(text):
            cause = checkpoint_io.short_error(text)
            return (f"a peer process was lost ({cause}); this process stops too. Start every "
                    "process again (the same command): the run resumes from its last "
                    "checkpoint")
        seen = seen.__cause__ or seen.__context__
    return None
