"""Test setup: 8 fake CPU devices (set before jax is imported) and shared fixtures."""
import gc
import os

from jax_env import xla_flags

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402
import signal  # noqa: E402

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """../shared/data (real datasets); tests needing it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent")
    return SHARED_DATA


@pytest.fixture
def terminal_signals():
    """SIGINT and SIGTERM as a terminal gives them to Python (and, through exec, SIG_DFL to a
    child), whatever the test process inherited: started in the background by a script
    (``nohup pytest … &``), SIGINT is ignored, and StopRequest rightly leaves an ignored
    signal ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler), \
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGINT, previous[0]), signal.signal(signal.SIGTERM, previous[1])


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml): one worker per core, at most 4. Each worker holds its own
    jax and torch and a step already uses several threads, so more workers only add memory."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_sessionfinish(session) -> None:
    """On a pytest-xdist worker: collect garbage now and freeze what is left. After a worker
    reports its last test, pytest runs five full collections over everything jax, torch and
    the tests left alive (~0.3 s each); execnet sends a worker still busy 5 s after the run
    ends a SIGINT, which surfaced as a KeyboardInterrupt in JAX's gc callback in the CI log.
    Frozen objects are skipped by those collections."""
    if hasattr(session.config, "workerinput"):
        gc.collect()
        gc.freeze()
