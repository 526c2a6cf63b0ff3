"""What the processes of a multi-process run must agree on, checked before anything is compiled
or written.

Each process parses its own command line, reads its own copy of the data and sees the workdir
through its own mount. A process started with other hyperparameters traces another program
around the one global state (a hang, or silently mixed updates); another vocabulary on one host
gives its ids other meanings; another copy of a split shifts its share of every global batch,
and an evaluation pass of another length waits forever in a collective; a workdir that is not
one shared directory leaves every checkpoint split between the hosts' disks. So each value is
exchanged (``hosts.gather``: two all-gathers of its JSON) and every process raises the same
error, naming the processes and keys that differ from process 0's: ``check_same_config``,
``check_same_data_identity``, ``check_same_splits``, ``check_same_init_from``.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
import platform
import uuid
from typing import Any, Callable

import jax
import ml_collections

from posjax import storage
from posjax.data import identity as identity_lib
from posjax.training import hosts
from posjax.training import init_from as init_from_lib
from posjax.training import run_config
from posjax.training import workdir as workdir_lib

SHOWN = 8   # differences named in one error


def differences(values: list[dict[str, Any]],
                show: Callable[[str, Any, Any], str]) -> list[str]:
    """'process i: ``show(key, its value, process 0's)``' for every key where a process's
    dict differs from process 0's (a key one of them lacks has the value None)."""
    first = values[0]
    return [f"process {i}: {show(key, other.get(key), first.get(key))}"
            for i, other in enumerate(values[1:], start=1)
            for key in sorted(set(first) | set(other)) if other.get(key) != first.get(key)]


def check_agree(values: Callable[[], dict[str, Any]], what: str, fix: str,
                show: Callable[[str, Any, Any], str] | None = None) -> None:
    """Raise, in every process, one ValueError when some process's ``values()`` (called only
    when there are ``hosts.several`` processes) differ from process 0's: 'the processes <what>:
    <differences>; <fix>'. ``show(key, value, process 0's value)`` words one difference
    (default 'key=value (process 0: value)')."""
    if not hosts.several():
        return
    found = differences(hosts.gather(values()), show or _show_value)
    if found:
        more = f"\n  ... and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
        raise ValueError(f"the processes {what}:\n  " + "\n  ".join(found[:SHOWN]) + more
                         + f"\n{fix}")


def _show_value(key: str, value: Any, first: Any) -> str:
    return f"{key}={_absent(value)} (process 0: {_absent(first)})"


def _absent(value: Any) -> str:
    return "<absent>" if value is None else repr(value)


# The distributions whose versions every process must share, besides Python and posjax's own
# source (a host with another checkout).
SOFTWARE = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy")


def software_versions() -> dict[str, str | None]:
    """{distribution: version (None: not installed)} of ``SOFTWARE``, Python's major.minor
    version (patch releases may differ), and a digest of posjax's source files (their paths and
    contents)."""
    versions: dict[str, str | None] = {}
    for name in SOFTWARE:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = ".".join(platform.python_version_tuple()[:2])
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    versions["posjax source"] = digest.hexdigest()[:16]
    return versions


def check_same_software() -> None:
    """Every process must run what process 0 runs (``software_versions``): another jax or
    posjax on one host traces another program around the one global state."""
    check_agree(software_versions, "run different software",
                "Install the same packages and the same posjax on every host.",
                lambda name, version, first: f"{name} {version} (process 0: {first})")


def check_shared_workdir(workdir: pathlib.Path, name: str | None = None) -> None:
    """Every process must read the file ``name`` in ``workdir`` as process 0 does (absent
    included): else the workdir is a directory on each host's own disk (or another path), and
    a checkpoint, each process writing or reading its own shards, is whole on none of them.
    Evaluation checks the run's config. Training (``name`` None) checks a probe that process 0
    writes under a new random name and removes after: no host can have that name cached as
    absent (NFS keeps a lookup that found nothing for up to a minute, e.g. of ``train.lock``
    after the last run removed it)."""
    if not hosts.several():
        return
    if storage.is_bucket(workdir):   # one store for every process: the same URL is the same
        urls = hosts.gather(os.fspath(workdir))
        if others := [i for i, url in enumerate(urls) if url != urls[0]]:
            raise ValueError(
                f"workdir {os.fspath(workdir)!r}: the processes were given other workdirs "
                f"(process 0: {urls[0]!r}; " + ", ".join(f"process {i}: {urls[i]!r}"
                                                        for i in others)
                + "): give every process the same --workdir")
        return
    probe = name is None
    if probe and jax.process_index() == 0:
        name = f".shared-workdir-check-{uuid.uuid4().hex}"
        with open(workdir / name, "x") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())   # on the server before the others read it
    try:
        # Process 0's name and view, once written (the gather waits for it); then whether
        # each process shares that view.
        first = [name, _read(workdir / name)] if jax.process_index() == 0 else None
        name, seen = hosts.gather(first)[0]
        shares = hosts.gather(_read(workdir / name) == seen)
    finally:
        if probe and jax.process_index() == 0:
            (workdir / name).unlink(missing_ok=True)
    missing = [i for i, shared in enumerate(shares) if not shared]
    if missing:
        plural = len(missing) > 1
        what = "a file that process 0 wrote" if probe else f"the {name} that process 0 sees"
        raise ValueError(
            f"workdir {str(workdir)!r} is not one directory shared by every process: "
            f"process{'es' if plural else ''} {', '.join(map(str, missing))} "
            f"{'do' if plural else 'does'} not see {what} there (a path on each host's own "
            "disk, or another --workdir?). Give every process the same --workdir, on a file "
            "system that every host mounts (NFS, Filestore): each process writes and reads its "
            "own part of every checkpoint there")


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def check_same_config(config: ml_collections.ConfigDict) -> None:
    """Every process must have process 0's config (``config.distributed`` may differ):
    ``check_agree``."""
    check_agree(lambda: {k: v for k, v in run_config.flattened(config).items()
                                   if not run_config.under(k, ("distributed",))},
                          "were started with different configs",
                          "Start every process with the same --config and --config.* flags "
                          "(only config.distributed may differ).")


def check_same_data_identity(config: ml_collections.ConfigDict,
                             data_identity: dict[str, Any]) -> None:
    """Every process's data files must mean what process 0's do (``data_identity``: the
    vocabulary), though the configs agree: a host with another copy under the same path."""
    def show(key: str, entry: Any, first: Any) -> str:
        ranges = workdir_lib.id_ranges(identity_lib.changed_blocks(first or {}, entry or {}))
        return f"{key}={run_config.flattened(config).get(key)!r} holds another vocabulary than " \
               f"process 0's (ids {ranges} differ)"

    check_agree(lambda: data_identity, "read different data",
                          "Give every host the same copy of the data files.", show)


def check_same_splits(pipelines: dict[str, Any]) -> None:
    """Every process's copy of each split must hold as many examples as process 0's (else its
    share of the global batches shifts, and an evaluation pass of another length waits forever
    in a collective). ``pipelines``: {"train" or "test": its pipeline (``num_examples``)}."""
    check_agree(
        lambda: {split: getattr(pipe, "num_examples", None) for split, pipe in pipelines.items()},
        "read different data",
        "Give every host the same copy of the data (the files or TFDS data_dir of config.data).",
        lambda split, n, first: f"its data.{split}_split has {n} examples (process 0: {first})")


def init_from_fingerprint(path: str | pathlib.Path) -> str | None:
    """A digest of what ``init_from`` holds (``pretrained_location``): the names and sizes of
    the checkpoint's files (Orbax names data files afresh at each save, so another checkpoint
    of the same model shows) and the model config. None when there is no such checkpoint."""
    try:
        params_dir, cfg_file = init_from_lib.pretrained_location(path)
    except ValueError:
        return None
    digest = hashlib.sha256()
    for file in sorted(f for f in params_dir.rglob("*") if f.is_file()):
        digest.update(f"{file.relative_to(params_dir)}\0{file.stat().st_size}\0".encode())
    if cfg_file.is_file():
        digest.update(cfg_file.read_bytes())
    return digest.hexdigest()[:16]


def check_same_init_from(path: str) -> None:
    """Every process must read the same weights from ``init_from`` (``path``) as process 0
    (``init_from_fingerprint``): a host with its own copy of another checkpoint under
    that path would load other parameters into its shards of the one model."""
    check_agree(
        lambda: {"init_from": init_from_fingerprint(path)}, "read different data",
        "Give every host the same copy of the weights (or keep them on a file system every "
        "host mounts), and start from a run's checkpoints only once it has stopped saving.",
        lambda key, mine, first: f"init_from={path!r} holds other weights than process 0's "
                                 f"({'none' if mine is None else 'another checkpoint'} there)")
