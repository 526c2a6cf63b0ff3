"""Keep XLA:CPU's per-step scratch block mapped between steps (glibc hosts).

XLA:CPU runs a compiled step in one scratch block that it allocates with ``posix_memalign``
at the start of every run and frees at the end (BERT-A small, batch 8 × 128: 676 MB). glibc
serves a block that large from a worker thread's arena with a fresh ``mmap`` and returns it
with ``munmap``, so every step faults the whole block in again, one zeroed 4 KiB page at a
time: 165,000 minor page faults per BERT-A step on the 2-core benchmark machine.

:func:`keep_freed_memory` tells glibc to serve every thread from the main heap, never to
``mmap`` and never to give the heap's top back to the kernel. The block is then reused from
step to step with no faults (``BENCHMARKS.md``, "Host memory"). The price is that the process
keeps its peak heap size, which a training or evaluation process reaches every step anyway.

It has to run before the XLA backend starts its threads (a thread keeps the arena of its first
allocation), i.e. before the first JAX computation; the ``python -m bench`` and
``python -m bench.ab`` entry points call it first thing. It is opt-in because one arena slows
small steps whose input pipeline allocates from other threads: the default ``python train.py``
job takes 55 s instead of 42 s with it. ``train.py`` gets the same policy from glibc's environment variables::

    MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 python train.py ...

It does nothing on a C library other than glibc, nor where JAX will run on an accelerator
(``JAX_PLATFORMS`` names another platform first, or a GPU/TPU plugin is installed): the
scratch block then lives on the device.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import platform

import jax

# mallopt(3) parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1   # mallopt takes an int: up to 2 GiB stays free at the heap's top

_kept = False


def jax_runs_on_cpu() -> bool:
    """Whether JAX's default backend will be the CPU, decided without starting any backend."""
    platforms = jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    plugins = list(importlib.metadata.entry_points(group="jax_plugins"))
    return not plugins and importlib.util.find_spec("libtpu") is None


def keep_freed_memory() -> bool:
    """One malloc arena, no ``mmap`` allocations, no heap trimming; True if glibc applied all.

    Idempotent. Returns False (and changes nothing) where the C library is not glibc or JAX
    will run on an accelerator.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if not jax_runs_on_cpu():
        return False
    global _kept
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX))
    _kept = all([libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1
                 for param, value in settings])
    return _kept


def kept() -> bool:
    """Whether :func:`keep_freed_memory` has applied its settings in this process."""
    return _kept
