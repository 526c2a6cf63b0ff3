"""A bucket of gcp-storage-emulator for tests (the ``emulator`` fixture, in tests/conftest.py).

The emulator (2026.7.19) ignores the generation preconditions of the JSON API
(ifGenerationMatch, ifGenerationNotMatch), sends no x-goog-generation header with an object's
bytes (nor the generation a multipart upload, google-cloud-storage's, names in its metadata is
checked), ignores startOffset/endOffset of a listing and drops the connection on an empty media
upload: ``_as_cloud_storage_does`` adds these four, as GCS documents them, to its handlers (it
serves one request at a time, so a check and the write it guards are atomic). Without them the
compare-and-swap tests fail, as they should."""
from __future__ import annotations

import json
import socket
from http import HTTPStatus

import pytest

from posjax import storage

BUCKET = "posjax-test"
_SET_BY_CONFIGURE = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
                     "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


def _as_cloud_storage_does(patch: pytest.MonkeyPatch) -> None:
    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def generation(request, name, store):
        try:
            return int(store.get_file_obj(request.params["bucket_name"], name)["generation"])
        except NotFound:
            return None

    def conditional(handler, name_of):
        def handle(request, response, store, *args, **kwargs):
            name = name_of(request)
            current = generation(request, name, store) if name else None
            match = request.query.get("ifGenerationMatch")
            not_match = request.query.get("ifGenerationNotMatch")
            if match and (current or 0) != int(match[0]):
                response.status = HTTPStatus.PRECONDITION_FAILED
                return response.json({"error": {"code": 412, "message": "conditionNotMet"}})
            if not_match and current == int(not_match[0]):
                response.status = HTTPStatus.NOT_MODIFIED
                return None
            if request.query.get("uploadType") == ["media"] and request.data is None:
                request._data = b""   # an empty object (its handler failed on no body)
            handler(request, response, store, *args, **kwargs)
            if response.status == HTTPStatus.OK and name:
                response["x-goog-generation"] = str(generation(request, name, store))
            return None
        return handle

    def ranged(request, response, store, *args, **kwargs):
        objects.ls(request, response, store, *args, **kwargs)
        low = request.query.get("startOffset", [""])[0]
        high = request.query.get("endOffset", [None])[0]
        if response.status == HTTPStatus.OK and (low or high):
            listing = json.loads(response._content)
            listing["items"] = [o for o in listing["items"]
                                if o["name"] >= low and (high is None or o["name"] < high)]
            response.json(listing)

    def inserted(request) -> str:   # a multipart upload names its object in its metadata
        if "name" in request.query or request.query.get("uploadType") != ["multipart"]:
            return request.query.get("name", [""])[0]
        return (request.data or {}).get("meta", {}).get("name", "")

    by_name = lambda request: request.params["object_id"]   # noqa: E731
    replace = {objects.insert: conditional(objects.insert, inserted),
               objects.get: conditional(objects.get, by_name),
               objects.download: conditional(objects.download, by_name),
               objects.delete: conditional(objects.delete, by_name), objects.ls: ranged}
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler in replace:
                patch.setitem(handlers, method, replace[handler])
    patch.setattr(objects, "insert", replace[objects.insert])   # the router's fallback


def refuse_uploads(patch: pytest.MonkeyPatch, refused, status: int = 403,
                   reason: str = "quotaExceeded") -> None:
    """From now on the emulator answers an upload of an object whose name ``refused(name)``
    holds with ``status`` and Cloud Storage's error body (a bucket over its quota, a billing
    account disabled, a permission revoked mid-run)."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    def wrap(handler):
        def handle(request, response, store, *args, **kwargs):
            name = request.query.get("name", [""])[0]
            if not name and isinstance(request.data, dict):   # multipart: in its metadata
                name = request.data.get("meta", {}).get("name", "")
            if name and refused(name):
                response.status = HTTPStatus(status)
                return response.json({"error": {"code": status, "message": f"{reason}: "
                                      f"the upload of {name} is refused", "errors": [
                                          {"reason": reason, "domain": "usageLimits"}]}})
            return handler(request, response, store, *args, **kwargs)
        return handle

    insert = objects.insert
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is insert:
                patch.setitem(handlers, method, wrap(handler))
    patch.setattr(objects, "insert", wrap(insert))


def emulator_bucket():
    """A bucket on gcp-storage-emulator (in memory, a thread of this process), with
    STORAGE_EMULATOR_HOST pointing at it."""
    emulator_server = pytest.importorskip(
        "gcp_storage_emulator.server",
        reason="gcp-storage-emulator is not installed (requirements-test.txt): gs:// untested")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as patch:
        _as_cloud_storage_does(patch)
        for name in _SET_BY_CONFIGURE:   # restored at the end
            patch.delenv(name, raising=False)
        patch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        storage.configure_emulator()
        server = emulator_server.create_server("127.0.0.1", port, in_memory=True,
                                               default_bucket=BUCKET)
        server.start()
        try:
            yield f"gs://{BUCKET}"
        finally:
            server.stop()


def main() -> None:
    """``python tests/gcs_emulator.py [--port 9023] [--bucket posjax-demo]``: the emulator with
    GCS's preconditions (the stock ``gcp-storage-emulator start`` lacks them: posjax's leases and
    appends need them), in memory, until Ctrl-C."""
    import argparse
    import time
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, default=9023)
    parser.add_argument("--bucket", default="posjax-demo")
    args = parser.parse_args()
    from gcp_storage_emulator import server as emulator_server
    with pytest.MonkeyPatch.context() as patch:
        _as_cloud_storage_does(patch)
        server = emulator_server.create_server("127.0.0.1", args.port, in_memory=True,
                                               default_bucket=args.bucket)
        server.start()
        print(f"serving gs://{args.bucket} at http://127.0.0.1:{args.port}: "
              f"export STORAGE_EMULATOR_HOST=http://127.0.0.1:{args.port}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            server.stop()


if __name__ == "__main__":
    main()
