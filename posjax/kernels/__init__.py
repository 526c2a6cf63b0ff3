"""Fused attention kernels (Pallas): ``pallas_attention`` (``posjax.kernels.flash``), run per
shard of a device mesh (``posjax.kernels.sharded``)."""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator

import jax

from posjax.kernels.flash import pallas_attention
from posjax.kernels.sharded import per_shard
from posjax.layers import blocked

KERNELS = ("blocked", "pallas", "pallas_interpret")
# Mosaic tiles the last two dimensions of a block in (8, 128): the kernel's key blocks (the key
# mask's (1, block) rows) must be a multiple of 128 tokens, or the whole (padded) length.
TPU_BLOCK = 128


def attention_fn(kernel: str) -> Callable:
    """The function that runs the memory-bounded path: ``blocked.blocked_attention`` (the
    plain-JAX scan) or the Pallas kernel, compiled (``pallas``: TPU) or in Pallas' interpreter
    (``pallas_interpret``: any backend). Both take ``blocked_attention``'s arguments."""
    if kernel == "blocked":
        return blocked.blocked_attention
    if kernel in ("pallas", "pallas_interpret"):   # per shard of the mesh (kernels.sharded)
        return per_shard(functools.partial(pallas_attention,
                                           interpret=kernel == "pallas_interpret"))
    raise ValueError(f"kernel={kernel!r}: choose one of {', '.join(KERNELS)}")


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("posjax_target",
                                                                     default=None)


def target_platform() -> str:
    """The platform the models are built for: ``jax.default_backend()``, or the one set by
    ``compiling_for`` (what 'auto' and 'pallas' look at)."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Build models inside for ``platform`` whatever the default backend: ``posjax.plan`` and
    the compile-only benchmarks compile for TPU devices (libtpu's topologies) on a CPU host,
    where 'auto' must take the path a TPU would run."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)
