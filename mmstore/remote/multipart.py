"""Multipart uploads to ``s3://`` part by part, so that a push resumes a large
file where it stopped (NOTE [resuming a push] in :mod:`mmstore.transfer.push`).

obstore uploads a file in parts but keeps the upload to itself: a process
killed midway leaves parts on the server that nobody can name. Here the
upload is named (its id goes into the push's journal before the first part);
a rerun asks the server which parts it holds (S3 lists each with the MD5 of
its bytes as its ETag), keeps those whose MD5 is the file's there, and sends
only the others. A part is signed with the SHA-256 of its bytes over plain
HTTP (botocore's default; over HTTPS the connection vouches for them). The requests go through boto3, with
the same settings the rest of the remote layer reads (``AWS_*`` environment
and shared files, ``MMSTORE_REMOTE_*`` retries and timeouts) and boto3's own
credential chain (instance roles, web identity) where no keys are set.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..errors import RemoteError
from .client import _env_number, _s3_config, translate
from .url import StoreURL

__all__ = ["MAX_PARTS", "S3Multipart", "multipart_available", "part_bytes_for"]

MAX_PARTS = 10_000  # S3's most parts in one upload
_MIB = 1 << 20


def multipart_available() -> bool:
    """boto3 can be imported (the ``remote`` extra installs it)."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        return False
    return True


def part_bytes_for(size: int, least: int) -> int:
    """The part size of a ``size``-byte upload: ``least``, or the next whole
    MiB that keeps it within ``MAX_PARTS`` parts."""
    need = -(-size // MAX_PARTS)
    return max(least, -(-need // _MIB) * _MIB)


class S3Multipart:
    """Named multipart uploads to the objects of one ``s3://`` store URL.
    Thread-safe; made and used in one process."""

    def __init__(self, loc: StoreURL, connections: int = 16) -> None:
        if loc.scheme != "s3":
            raise ValueError(f"{loc.url}: multipart uploads by part are for s3:// URLs")
        self.loc = loc
        self._connections = max(1, connections)
        self._client: Any = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _s3(self) -> Any:
        if self._client is not None and self._pid == os.getpid():
            return self._client
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                import boto3
                from botocore.config import Config

                cfg, _ = _s3_config()
                config = Config(
                    region_name=cfg["region"], max_pool_connections=self._connections,
                    retries={"max_attempts": int(_env_number("MMSTORE_REMOTE_RETRIES", 10)) + 1, "mode": "standard"},
                    connect_timeout=_env_number("MMSTORE_REMOTE_CONNECT_TIMEOUT", 10),
                    read_timeout=_env_number("MMSTORE_REMOTE_TIMEOUT", 120),
                    request_checksum_calculation="when_required", response_checksum_validation="when_required",
                    s3={"addressing_style": "path"} if cfg.get("endpoint") else None,
                )
                keys = {k: cfg[k] for k in ("access_key_id", "secret_access_key", "session_token") if k in cfg}
                client = boto3.session.Session().client(
                    "s3", endpoint_url=cfg.get("endpoint"), config=config,
                    **{f"aws_{k}": v for k, v in keys.items()})
                self._client = client
                self._pid = os.getpid()
        return self._client

    def _key(self, name: str) -> str:
        return f"{self.loc.prefix}/{name}"

    def _error(self, exc: BaseException, name: str, doing: str) -> RemoteError:
        return translate(exc, self.loc.object_url(name), doing)

    def create(self, name: str) -> str:
        """Start an upload of object ``name``; its id."""
        try:
            got = self._s3().create_multipart_upload(Bucket=self.loc.bucket, Key=self._key(name))
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            raise self._error(exc, name, "start an upload of") from exc
        return str(got["UploadId"])

    def put_part(self, name: str, upload_id: str, number: int, data: bytes) -> str:
        """Send part ``number`` (from 1) of the upload; the ETag the server gave it."""
        try:
            got = self._s3().upload_part(Bucket=self.loc.bucket, Key=self._key(name), UploadId=upload_id,
                                         PartNumber=number, Body=data)
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            raise self._error(exc, name, f"upload part {number} of") from exc
        return str(got["ETag"])

    def parts(self, name: str, upload_id: str) -> dict[int, tuple[str, int]] | None:
        """The parts the server holds for the upload: number -> (ETag, size);
        None when there is no such upload (completed, aborted or expired)."""
        out: dict[int, tuple[str, int]] = {}
        marker = 0
        try:
            while True:
                got = self._s3().list_parts(Bucket=self.loc.bucket, Key=self._key(name), UploadId=upload_id,
                                            PartNumberMarker=marker, MaxParts=1000)
                for p in got.get("Parts", []):
                    out[int(p["PartNumber"])] = (str(p["ETag"]), int(p["Size"]))
                if not got.get("IsTruncated"):
                    return out
                nxt = int(got.get("NextPartNumberMarker") or 0)
                if nxt <= marker:
                    return out  # a server that does not move on: what it gave
                marker = nxt
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            if _code(exc) in ("NoSuchUpload", "NoSuchKey", "404"):
                return None
            raise self._error(exc, name, "list the uploaded parts of") from exc

    def complete(self, name: str, upload_id: str, etags: list[str]) -> str:
        """Join parts 1..len(etags) into object ``name``; its ETag."""
        parts = [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]
        try:
            got = self._s3().complete_multipart_upload(Bucket=self.loc.bucket, Key=self._key(name),
                                                       UploadId=upload_id, MultipartUpload={"Parts": parts})
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            raise self._error(exc, name, "complete the upload of") from exc
        return str(got["ETag"])

    def uploads(self) -> list[tuple[str, str, str]]:
        """The multipart uploads under way under the store's prefix, as
        ``(name, upload id, when it was started)``; ``name`` is the key
        below the prefix (it may hold ``/``: the caller decides which are the
        store's own)."""
        out: list[tuple[str, str, str]] = []
        head = f"{self.loc.prefix}/"
        kw: dict[str, Any] = {}
        try:
            while True:
                got = self._s3().list_multipart_uploads(Bucket=self.loc.bucket, Prefix=head, MaxUploads=1000, **kw)
                for u in got.get("Uploads", []):
                    key = str(u.get("Key", ""))
                    if key.startswith(head) and u.get("UploadId"):
                        out.append((key[len(head):], str(u["UploadId"]), str(u.get("Initiated", ""))))
                key_marker, id_marker = got.get("NextKeyMarker"), got.get("NextUploadIdMarker")
                if not got.get("IsTruncated") or not (key_marker or id_marker):
                    return out
                nxt = {"KeyMarker": key_marker or "", "UploadIdMarker": id_marker or ""}
                if nxt == kw:
                    return out  # a server that does not move on: what it gave
                kw = nxt
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            raise translate(exc, self.loc.url, "list the unfinished uploads under") from exc

    def abort(self, name: str, upload_id: str) -> None:
        """Drop an upload and its parts (one that is gone already is fine)."""
        try:
            self._s3().abort_multipart_upload(Bucket=self.loc.bucket, Key=self._key(name), UploadId=upload_id)
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            if _code(exc) not in ("NoSuchUpload", "NoSuchKey", "404"):
                raise self._error(exc, name, "abort the upload of") from exc


def _code(exc: BaseException) -> str:
    """The S3 error code of a botocore ``ClientError`` ('' for anything else)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""
