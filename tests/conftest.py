"""Test setup: 8 fake CPU devices (set before jax is imported) and shared fixtures."""
import gc
import os

from jax_env import xla_flags

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402
import signal  # noqa: E402

import pytest  # noqa: E402

REQUIRE_DATA_ENV = "POSJAX_REQUIRE_DATA"   # CI sets it: a missing data folder fails, not skips


def data_required() -> bool:
    """True when ``$POSJAX_REQUIRE_DATA`` is set to anything but '' or '0' (CI)."""
    return os.environ.get(REQUIRE_DATA_ENV, "") not in ("", "0")


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """The real datasets: ``$POSJAX_DATA``, else ../shared/data (``config_defaults.data_root``,
    where configs/ look too). Absent: tests needing it skip with one line, or fail where
    ``$POSJAX_REQUIRE_DATA`` is set (CI), so that they never silently stop running there."""
    from posjax.config_defaults import DATA_ENV, data_root   # here: it imports jax
    folder = pathlib.Path(data_root())
    if not folder.is_dir():
        how = f"set {DATA_ENV} to the folder holding the datasets (README, Tests)"
        if data_required():
            pytest.fail(f"real data folder {folder} is absent and {REQUIRE_DATA_ENV} is set: "
                        f"{how}", pytrace=False)
        pytest.skip(f"real data folder {folder} is absent: {how}")
    return folder


@pytest.fixture(scope="session")
def emulator():
    """``gs://<bucket>`` of gcp-storage-emulator (tests/gcs_emulator.py), STORAGE_EMULATOR_HOST
    pointing at it; skipped where the emulator is not installed."""
    from gcs_emulator import emulator_bucket
    yield from emulator_bucket()


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
