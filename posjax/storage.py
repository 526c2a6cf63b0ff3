"""Workdir storage in a local folder (the file system's semantics) or a Cloud Storage bucket
(``gs://``: TensorStore's ``gcs`` kvstore; writes and deletes take a generation precondition,
the compare-and-swap standing in for locks and renames). Failures raise OSError. Generations
are opaque: the object's on GCS; locally inode, mtime, size and digest, swapped under a
``flock`` of ``.<name>.cas`` beside the file (processes of one machine)."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import socket
import threading
import time
import uuid
from typing import Any, Iterator

from posjax.io_utils import local_path, write_atomically as _write_file_atomically

SCHEME, LOCK_FILE = "gs://", "train.lock"
_ABSENT = "02"   # the generation of no object (create-only): TensorStore's b"\x02", in hex


def configure_emulator() -> None:
    """``STORAGE_EMULATOR_HOST`` set, ``TENSORSTORE_GCS_HTTP_URL`` not: TensorStore goes there
    too, with a fixed token (no credential look-up); gcsfs keeps off storage-control's API."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host not in ("", "default") and "TENSORSTORE_GCS_HTTP_URL" not in os.environ:
        url = host if "://" in host else f"http://{host}"
        os.environ.update(TENSORSTORE_GCS_HTTP_URL=url.rstrip("/"),
                          GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator",
                          GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")


configure_emulator()


def is_bucket(path: str | os.PathLike) -> bool:
    return os.fspath(path).startswith(SCHEME)   # gs://bucket/... (other URLs: not supported)


def check_credentials(value: str | os.PathLike, what: str = "path") -> None:
    """A bucket path without Google Cloud credentials (and no emulator set) is one ValueError
    naming ``what`` and the fix, before anything is compiled: not a hang in the clients'
    retries at the first save. Local paths: nothing to check."""
    if not is_bucket(value) or os.environ.get("STORAGE_EMULATOR_HOST", "") not in ("",
                                                                                 "default"):
        return
    import google.auth   # noqa: PLC0415 -- gcsfs's dependency
    from google.auth import exceptions   # noqa: PLC0415
    try:
        google.auth.default()
    except exceptions.DefaultCredentialsError as e:
        raise ValueError(
            f"{what} {os.fspath(value)}: no Google Cloud credentials found "
            f"({str(e).splitlines()[0]}). On a TPU/GCE VM its service account is used; "
            "elsewhere run `gcloud auth application-default login` or set "
            "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file "
            "(STORAGE_EMULATOR_HOST: a local emulator)") from None


def as_path(value: str | os.PathLike, what: str = "path") -> Any:
    """``gs://...`` as an ``etils.epath.Path`` (through gcsfs, which must be installed); else
    the absolute local ``pathlib.Path`` (``io_utils.local_path``: other URLs are refused)."""
    if not is_bucket(value):
        return local_path(value, what)
    _split(value)
    from etils import epath   # noqa: PLC0415
    return epath.Path(os.fspath(value))


def path(value: str | os.PathLike) -> Any:
    """``value`` as a path object: ``gs://...`` as ``as_path`` makes it; a local path as a
    ``pathlib.Path``, unchanged (relative stays relative); a path object as it is."""
    if isinstance(value, pathlib.PurePath) or not is_bucket(value):
        return value if isinstance(value, pathlib.PurePath) else pathlib.Path(value)
    return as_path(value)


def files(directory: str | os.PathLike) -> list[str]:
    """The names of the objects under the bucket folder ``directory``, relative to it, sorted
    (one listing; a local folder: ``rglob``'s files)."""
    if not is_bucket(directory):
        root = pathlib.Path(directory)
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    with _object(directory) as (kv, prefix):
        found = kv.list(kv.KeyRange(prefix + "/", prefix + "0") if prefix else None).result()
    return sorted(k.decode()[len(prefix) + 1 if prefix else 0:] for k in found)


def _split(path: str | os.PathLike) -> tuple[str, str]:
    bucket, _, key = os.fspath(path)[len(SCHEME):].partition("/")
    if not bucket:
        raise ValueError(f"{os.fspath(path)!r} names no bucket: write gs://<bucket>/<path>")
    return bucket, key.strip("/")


@contextlib.contextmanager
def _object(path: str | os.PathLike) -> Iterator[tuple[Any, str]]:
    """(the bucket's kvstore, the object's name); TensorStore's errors raised as OSError."""
    import tensorstore as ts   # noqa: PLC0415
    bucket, key = _split(path)
    try:   # an open takes ~10 us: TensorStore keeps the driver
        yield ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result(), key
    except ValueError as e:
        raise OSError(f"{os.fspath(path)}: {e}") from e


def _local_generation(stat: os.stat_result, data: bytes) -> str:
    return f"{stat.st_ino}-{stat.st_mtime_ns}-{stat.st_size}-{hashlib.sha1(data).hexdigest()}"


def read_with_generation(path: str | os.PathLike) -> tuple[bytes, str] | None:
    """(the bytes of ``path``, their generation), read together; None if it does not exist."""
    if not is_bucket(path):
        try:
            with open(path, "rb") as f:
                return (data := f.read()), _local_generation(os.fstat(f.fileno()), data)
        except FileNotFoundError:
            return None
    with _object(path) as (kv, key):
        read = kv.read(key).result()
    if read.state != "value":
        return None
    if not read.stamp.generation.strip(b"\0"):   # no x-goog-generation: a CAS would be blind
        raise OSError(f"{os.fspath(path)}: the storage server sent no object generation")
    return read.value, read.stamp.generation.hex()


def _put(path: str | os.PathLike, data: bytes | None, expected: str | None) -> str | None:
    """Write ``data`` (None: delete) if ``path`` has the generation ``expected`` (None: in any
    case; ``_ABSENT``: if it does not exist): the new generation ("" once deleted), or None."""
    if is_bucket(path):
        condition = None if expected is None else bytes.fromhex(expected)
        with _object(path) as (kv, key):
            written = kv.write(key, data, if_equal=condition).result().generation
        return None if written == b"" else "" if data is None else written.hex()
    path = pathlib.Path(path)
    with open(path.with_name(f".{path.name}.cas"), "ab") as lock:   # closing it unlocks
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = read_with_generation(path)
        if expected is not None and (current[1] if current else _ABSENT) != expected:
            return None
        if data is None:
            path.unlink()
            return ""
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            tmp.write_bytes(data)
            generation = _local_generation(tmp.stat(), data)
            os.replace(tmp, path)   # readers see the old file or the new, whole
            return generation
        finally:
            tmp.unlink(missing_ok=True)


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` by ``data``: readers see the old bytes or the new, never a mix (local:
    a temporary file renamed over it, ``io_utils.write_atomically``; GCS: one upload)."""
    if is_bucket(path):
        _put(path, data, None)
    else:
        _write_file_atomically(pathlib.Path(path), lambda tmp: tmp.write_bytes(data))


def create_only(path: str | os.PathLike, data: bytes) -> bool:
    """Create ``path`` holding ``data`` (seen whole) unless it exists: False if it does."""
    return _put(path, data, _ABSENT) is not None


def replace_if_generation(path: str | os.PathLike, data: bytes, generation: str) -> bool:
    """Replace ``path`` by ``data`` if it still has ``generation``; False if not (or gone)."""
    return _put(path, data, generation) is not None


def delete_if_generation(path: str | os.PathLike, generation: str) -> bool:
    """Delete ``path`` if it still has ``generation``; False if not (or already gone)."""
    return _put(path, None, generation) is not None


def append_line(path: str | os.PathLike, line: str, attempts: int = 20) -> None:
    """Add ``line`` and a newline to the end of ``path`` (created if missing). Local: one
    O_APPEND write. GCS has no append: the object is read and rewritten with its generation as
    precondition, again on a conflict, so concurrent appenders lose no line. Each append moves
    the whole object down and up; GCS takes about one write per second to one object."""
    data = (line.rstrip("\n") + "\n").encode()
    if not is_bucket(path):
        with open(path, "ab", buffering=0) as f:
            f.write(data)
        return
    for attempt in range(attempts):
        current = read_with_generation(path)
        before, expected = current if current else (b"", _ABSENT)
        if _put(path, before + data, expected) is not None:
            return
        time.sleep(min(0.05 * 2 ** attempt, 1.0))
    raise OSError(f"{os.fspath(path)}: no line appended in {attempts} tries (other writers?)")


def move(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> None:
    """Move directory ``src_dir`` to ``dst_dir``, which must not exist. Local: one atomic
    rename. GCS has no rename: each object is copied (through this host, one at a time), then
    the originals deleted, ``commit_success.txt`` first. Not atomic: a crash while copying
    leaves ``src_dir`` whole and part of ``dst_dir`` (delete it, move again); one while
    deleting, ``dst_dir`` whole and a rest of ``src_dir`` that Orbax sees as no saved step."""
    if not is_bucket(src_dir):
        if os.path.lexists(dst_dir):
            raise FileExistsError(f"{os.fspath(dst_dir)} exists")
        return os.rename(src_dir, dst_dir)
    if not is_bucket(dst_dir) or _split(src_dir)[0] != _split(dst_dir)[0]:
        raise ValueError(f"cannot move {os.fspath(src_dir)} out of its bucket")
    with _object(src_dir) as (kv, src), _object(dst_dir) as (_, dst):
        def names(prefix: str) -> list[str]:   # the objects under prefix/ ("0" follows "/")
            found = kv.list(kv.KeyRange(prefix + "/", prefix + "0")).result() if prefix else []
            return sorted(k.decode() for k in found)
        if not (found := names(src)) or not dst:
            raise FileNotFoundError(f"{os.fspath(src_dir)}: no such directory")
        if names(dst):
            raise FileExistsError(f"{os.fspath(dst_dir)} exists")
        for name in found:
            kv.write(dst + name[len(src):], kv.read(name).result().value).result()
        for name in sorted(found, key=lambda n: (not n.endswith("/commit_success.txt"), n)):
            kv.write(name, None).result()


@contextlib.contextmanager
def bucket_lease(workdir: str | os.PathLike, renew_s: float = 10.0,
                 expire_s: float | None = None) -> Iterator[threading.Event]:
    """Hold ``<workdir>/train.lock`` inside the block: created only where absent, renewed every
    ``renew_s`` by a thread, deleted on exit if still ours (each if-generation). Another run's
    lease renewed less than ``expire_s`` (3 x renew_s) ago refuses this run (ValueError naming
    its holder); an older one is taken over with its generation as precondition: of several
    takers one wins. Expiry compares the holder's clock with this host's (NTP-synchronised).
    Yields an Event set once the lease is lost (taken over, or not renewed for ``expire_s``):
    the run must then stop writing to the workdir."""
    expire_s = 3 * renew_s if expire_s is None else expire_s
    path, generation = os.fspath(workdir).rstrip("/") + "/" + LOCK_FILE, None
    lost, stop = threading.Event(), threading.Event()
    me = {"pid": os.getpid(), "host": socket.gethostname(), "token": uuid.uuid4().hex,
          "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    record = lambda: json.dumps({**me, "renewed": time.time()}).encode()   # noqa: E731
    while generation is None:
        current = read_with_generation(path)
        try:   # the holder, and the seconds since it renewed
            h = json.loads(current[0]) if current else None
            holder = h and f"pid {h['pid']} on host {h['host']}, since {h['since']}"
            age = time.time() - h["renewed"] if h else float("inf")
        except (ValueError, KeyError, TypeError):
            holder, age = "an unreadable lease record", float("inf")
        if age < expire_s:
            raise ValueError(
                f"workdir {os.fspath(workdir)!r} is in use by another training run ({holder}; "
                f"lease renewed {max(age, 0):.0f} s ago, expiring {expire_s:.0f} s after its "
                "last renewal): wait for it to end, or stop it (SIGTERM saves a checkpoint) and "
                "start this run again to resume there; or use another --workdir")
        generation = _put(path, record(), current[1] if current else _ABSENT)
        if current and generation is not None:
            logging.warning("workdir %s: took over the lease of %s, last renewed %.0f s ago",
                            os.fspath(workdir), holder, age)

    def renew() -> None:
        nonlocal generation
        renewed = time.monotonic()
        while not stop.wait(renew_s):
            try:
                generation = _put(path, record(), generation)
                renewed = time.monotonic()
            except OSError as e:
                logging.warning("lease %s not renewed (%s)", path, e)
                if time.monotonic() - renewed >= expire_s:
                    generation = None
            if generation is None:
                logging.error("lease %s lost: taken over by another run, or expired", path)
                return lost.set()

    thread = threading.Thread(target=renew, name="posjax-lease", daemon=True)
    thread.start()
    try:
        yield lost
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(OSError):   # else it expires expire_s after its last renewal
            if not lost.is_set() and not delete_if_generation(path, generation):
                logging.warning("lease %s was no longer this run's at exit", path)
