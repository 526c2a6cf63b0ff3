"""posjax.storage on a local folder and on a bucket of gcp-storage-emulator (test extra).

The emulator (2026.7.19) ignores the generation preconditions of the JSON API
(ifGenerationMatch, ifGenerationNotMatch), sends no x-goog-generation header with an object's
bytes, ignores startOffset/endOffset of a listing and drops the connection on an empty media
upload: ``gcs_emulator._as_cloud_storage_does`` adds these four, as GCS documents them, to its handlers (it
serves one request at a time, so a check and the write it guards are atomic). Without them the
compare-and-swap tests fail, as they should."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import threading
import time
import uuid

import pytest

from posjax import storage
from gcs_emulator import _SET_BY_CONFIGURE


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path) -> str:
    """An empty directory: a local one, or a fresh prefix of the emulator's bucket."""
    if request.param == "local":
        return str(tmp_path)
    return f"{request.getfixturevalue('emulator')}/{uuid.uuid4().hex}"


def _read(path: str) -> bytes | None:
    found = storage.read_with_generation(path)
    return None if found is None else found[0]


def _names(root: str) -> list[str]:
    """The files under ``root``, relative to it."""
    if not storage.is_bucket(root):
        return sorted(str(p.relative_to(root)) for p in pathlib.Path(root).rglob("*")
                      if p.is_file())
    with storage._object(root) as (kv, prefix):
        names = kv.list(kv.KeyRange(prefix + "/", prefix + "0")).result()
    return sorted(n.decode()[len(prefix) + 1:] for n in names)


def test_configure_emulator_maps_the_host_once(monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9023")
    for name in _SET_BY_CONFIGURE:
        monkeypatch.delenv(name, raising=False)
    storage.configure_emulator()
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:9023"
    assert "GOOGLE_AUTH_TOKEN_FOR_TESTING" in os.environ
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", "http://elsewhere:1")
    storage.configure_emulator()
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://elsewhere:1"


def test_paths(tmp_path):
    assert storage.is_bucket("gs://b/run") and not storage.is_bucket(tmp_path)
    assert storage.as_path(str(tmp_path)) == tmp_path.resolve()
    assert os.fspath(storage.as_path("gs://b/run") / "x") == "gs://b/run/x"
    with pytest.raises(ValueError, match="is a URL"):
        storage.as_path("s3://b/run", "--workdir")
    with pytest.raises(ValueError, match="names no bucket"):
        storage.as_path("gs:///run")


def test_epath_on_the_bucket(emulator):
    pytest.importorskip("gcsfs", reason="gcsfs is not installed: epath cannot open gs://")
    run = storage.as_path(f"{emulator}/{uuid.uuid4().hex}")
    (run / "config.json").write_text("{}")
    assert (run / "config.json").exists() and (run / "config.json").read_text() == "{}"
    assert [p.name for p in run.iterdir()] == ["config.json"]


def test_write_atomically_is_whole(root):
    path, old, new = f"{root}/config.json", b"a" * 300_000, b"b" * 200_000
    storage.write_atomically(path, old)
    seen, done = set(), threading.Event()

    def reader():
        while not done.is_set():
            seen.add(_read(path))

    thread = threading.Thread(target=reader)
    thread.start()
    for data in (new, old, new):
        storage.write_atomically(path, data)
    done.set()
    thread.join()
    assert seen <= {old, new} and _read(path) == new
    assert _names(root) == ["config.json"]   # no temporary file left


def test_create_only_once(root):
    path = f"{root}/marker"
    assert storage.create_only(path, b"first")
    assert not storage.create_only(path, b"second")
    assert _read(path) == b"first"


def test_generations_guard_replace_and_delete(root):
    path = f"{root}/record"
    storage.write_atomically(f"{root}/other", b"0")
    _, foreign = storage.read_with_generation(f"{root}/other")
    assert not storage.replace_if_generation(path, b"x", foreign)   # none yet
    storage.write_atomically(path, b"one")
    _, first = storage.read_with_generation(path)
    assert storage.replace_if_generation(path, b"two", first)
    assert not storage.replace_if_generation(path, b"three", first)   # stale
    assert _read(path) == b"two"
    assert not storage.delete_if_generation(path, first)
    _, second = storage.read_with_generation(path)
    assert second != first and storage.delete_if_generation(path, second)
    assert storage.read_with_generation(path) is None
    assert not storage.delete_if_generation(path, second)


def test_append_line_keeps_every_line_in_order(root):
    path = f"{root}/metrics.jsonl"

    def append(tag):
        for i in range(6):
            storage.append_line(path, json.dumps({"writer": tag, "i": i}))

    threads = [threading.Thread(target=append, args=(tag,)) for tag in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = [json.loads(line) for line in _read(path).decode().splitlines()]
    for tag in "ab":
        assert [r["i"] for r in records if r["writer"] == tag] == list(range(6))
    assert len(records) == 12


def test_move(root):
    files = {"7/_CHECKPOINT_METADATA": b"m", "7/state/commit_success.txt": b"",
             "7/commit_success.txt": b"", "7/state/d/abc": b"x" * 1000, "8/other": b"o"}
    for name, data in files.items():
        if not storage.is_bucket(root):
            os.makedirs(os.path.dirname(f"{root}/{name}"), exist_ok=True)
        storage.write_atomically(f"{root}/{name}", data)
    storage.move(f"{root}/7", f"{root}/7.damaged-checksum")
    assert _names(root) == sorted(n.replace("7/", "7.damaged-checksum/") for n in files)
    assert _read(f"{root}/7.damaged-checksum/state/d/abc") == b"x" * 1000
    with pytest.raises(FileExistsError):
        storage.move(f"{root}/8", f"{root}/7.damaged-checksum")
    with pytest.raises(FileNotFoundError):
        storage.move(f"{root}/7", f"{root}/9")


def _stale_record(pid=4242, host="elsewhere", age=600.0) -> bytes:
    return json.dumps({"pid": pid, "host": host, "since": "2026-01-01 00:00:00 UTC",
                       "token": "old", "renewed": time.time() - age}).encode()


def test_lease_refuses_a_second_run_and_is_released(root):
    lock = f"{root}/{storage.LOCK_FILE}"
    with storage.bucket_lease(root, renew_s=0.1) as lost:
        held = json.loads(_read(lock))
        assert (held["pid"], held["host"]) == (os.getpid(), socket.gethostname())
        with pytest.raises(ValueError, match=rf"in use by another training run \(pid "
                                             rf"{os.getpid()} on host {socket.gethostname()}"):
            with storage.bucket_lease(root, renew_s=0.1, expire_s=30):
                pass
        time.sleep(0.35)   # renewed meanwhile, still ours
        assert json.loads(_read(lock))["renewed"] > held["renewed"] and not lost.is_set()
    assert _read(lock) is None
    with storage.bucket_lease(root, renew_s=0.1):   # free again
        pass


def test_stale_lease_is_taken_over_and_its_holder_learns_it(root):
    lock = f"{root}/{storage.LOCK_FILE}"
    storage.create_only(lock, _stale_record())
    with storage.bucket_lease(root, renew_s=0.1) as lost:
        assert json.loads(_read(lock))["pid"] == os.getpid()
        _, generation = storage.read_with_generation(lock)
        assert storage.replace_if_generation(lock, _stale_record(pid=5, age=0), generation)
        assert lost.wait(5)
    assert json.loads(_read(lock))["pid"] == 5   # not deleted: no longer ours


def test_two_takers_of_a_stale_lease_one_wins(root, monkeypatch):
    storage.create_only(f"{root}/{storage.LOCK_FILE}", _stale_record())
    read, met, release = storage.read_with_generation, threading.Barrier(4), threading.Event()
    won, refused, taker = [], [], threading.local()

    def read_then_meet(path):   # every taker has seen the stale lease before any takes it
        found = read(path)
        if getattr(taker, "first_read", False):
            taker.first_read = False
            met.wait(10)
        return found

    monkeypatch.setattr(storage, "read_with_generation", read_then_meet)

    def take():
        taker.first_read = True
        try:
            with storage.bucket_lease(root, renew_s=0.2, expire_s=30):
                won.append(1)
                release.wait(10)
        except ValueError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(won) + len(refused) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    release.set()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 3
    assert all(f"pid {os.getpid()}" in message for message in refused)
    assert _read(f"{root}/{storage.LOCK_FILE}") is None
