"""Environment for the test processes (conftest.py) and for the processes the tests start."""
from __future__ import annotations

import pathlib

# LLVM's optimisation passes off: the suite is mostly compiles of tiny models, which then take
# 2-4x less time (digits :tiny init 3.1 -> 0.9 s, train step 3.9 -> 2.0 s; the suite's summed
# test time 2341 -> 1488 s on 2 cores). XLA's own HLO passes still run and the programs compute
# the same values; only their machine code is slower, which tiny models do not feel. The
# benchmarks (bench/) run with XLA's defaults.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int = 1) -> str:
    """XLA_FLAGS for a test process with ``devices`` simulated CPU devices."""
    if devices == 1:
        return FAST_COMPILE
    return f"{FAST_COMPILE} --xla_force_host_platform_device_count={devices}"


def compilation_cache(directory: pathlib.Path) -> dict[str, str]:
    """Variables that make the processes started with them share JAX's persistent compilation
    cache in ``directory``: a program they all run compiles once (in a multi-process run,
    process 0 writes the entries and every process reads them)."""
    return {"JAX_COMPILATION_CACHE_DIR": str(directory),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
