"""Fused attention kernels (Pallas): ``pallas_attention`` (``posjax.kernels.flash``)."""
from __future__ import annotations

import functools
from typing import Callable

from posjax.kernels.flash import pallas_attention
from posjax.layers import blocked

KERNELS = ("blocked", "pallas", "pallas_interpret")


def attention_fn(kernel: str) -> Callable:
    """The function that runs the memory-bounded path: ``blocked.blocked_attention`` (the
    plain-JAX scan) or the Pallas kernel, compiled (``pallas``: TPU) or in Pallas' interpreter
    (``pallas_interpret``: any backend). Both take ``blocked_attention``'s arguments."""
    if kernel == "blocked":
        return blocked.blocked_attention
    if kernel in ("pallas", "pallas_interpret"):
        return functools.partial(pallas_attention, interpret=kernel == "pallas_interpret")
    raise ValueError(f"kernel={kernel!r}: choose one of {', '.join(KERNELS)}")
