"""Store URLs: which strings name a store in object storage, and how.

``s3://BUCKET/PREFIX/NAME.store``, ``gs://BUCKET/...``, ``az://CONTAINER/...``
(also ``azure://``, ``abfs://``), ``http://`` and ``https://`` name a store in
object storage: the objects under that prefix are the store's files, by
their names (``s3://b/train.store/manifest.json``, ...). An ``http(s)://``
URL names a store published read-only over HTTP (``https://HOST/PATH/NAME.store``:
its files at ``.../NAME.store/manifest.json``, ...), by a web server or a
bucket's public endpoint. ``file://PATH`` and a plain path name a local store,
as always.

A string that starts like a URL but is not one of these (``ftp://host/x``,
``s4://b/x``, ``s3:/bucket/x`` with one slash) is refused with
``StoreURLError`` naming the supported schemes, never taken as a local path;
so is a store URL without a bucket or a store path (``s3://``,
``s3://bucket``). A local directory whose name starts like a URL is named
``./ftp:/...`` (a relative path starting with ``./``) or by its absolute path.

A bucket (or container) name holds letters, digits, dots, hyphens and
underscores only: a space, a control character, a ``%`` escape or any other
character is refused with ``StoreURLError`` naming it. The endpoint of an
S3-compatible server (its host, port and credentials) is never part of an
``s3://`` URL: ``s3://user@bucket/x`` and ``s3://bucket:9000/x`` are refused,
pointing to ``AWS_ENDPOINT_URL`` and the ``AWS_*`` credentials. A store's
path may hold any character but a control character (``%0A`` included).

Commands that write a local store (ingest, merge, convert, the destination
of pull) refuse a store URL as their destination (:func:`local_dest`): a
store reaches object storage by ``push`` (or :func:`mmstore.ray.write`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from ..errors import StoreURLError

__all__ = ["REMOTE_SCHEMES", "StoreURL", "check_location", "is_url", "local_dest", "local_path", "parse_url"]

REMOTE_SCHEMES = ("s3", "gs", "az", "azure", "abfs", "abfss", "http", "https")
# a string that starts as a URL does: a scheme of two characters or more, a colon and a slash
# (one letter and a colon is a drive, not a scheme; a colon followed by anything else is a name)
_URL_LIKE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):/")
# a supported scheme and a colon, whatever follows (``s3:bucket/x``, ``s3:/bucket/x``)
_SCHEME_COLON = re.compile(r"^(" + "|".join(REMOTE_SCHEMES) + r"):", re.IGNORECASE)
_SHAPE = "s3://BUCKET/PATH/NAME.store"
# what a bucket or container name may hold: S3 (legacy names included), GCS and Azure's names
# are letters, digits, dots, hyphens and underscores; abfs(s) adds ``container@account.host``
_BUCKET_CHARS = re.compile(r"[A-Za-z0-9._\-]+\Z")
_ABFS_CHARS = re.compile(r"[A-Za-z0-9._@\-]+\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _supported() -> str:
    return ", ".join(s + "://" for s in REMOTE_SCHEMES)


def is_url(location: object) -> bool:
    """``location`` is a string naming a store in object storage."""
    if not isinstance(location, str):
        return False
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.lower() in REMOTE_SCHEMES


def check_location(location: object) -> None:
    """``StoreURLError`` for a string that starts like a URL but is neither
    a store URL nor ``file://`` (see the module docstring); nothing for a
    store URL (:func:`parse_url` checks it) or a local path."""
    if not isinstance(location, str) or is_url(location) or location.lower().startswith("file://"):
        return
    m = _SCHEME_COLON.match(location)
    if m:
        scheme = m.group(1).lower()
        raise StoreURLError(
            f"{location!r}: a store URL has two slashes after '{scheme}:': expected "
            f"{scheme}://{'HOST' if scheme in ('http', 'https') else 'BUCKET'}/PATH/NAME.store (a store URL starts "
            f"with one of {_supported()}; a local directory with this name is ./{location})")
    m = _URL_LIKE.match(location)
    if m and m.group(1).lower() != "file":
        raise StoreURLError(
            f"{location!r}: {m.group(1)}:// is not a scheme mmstore reads: a store URL starts with one of "
            f"{_supported()} (e.g. {_SHAPE}); a local directory with this name is ./{location}")


def local_dest(location: str | os.PathLike[str]) -> str:
    """A location where a local store is written, as a path (as
    :func:`local_path`); ``StoreURLError`` for a store URL: ingest, merge,
    convert and pull write local stores, and a store URL there would
    otherwise be taken as a directory named ``s3:``."""
    if is_url(location):
        raise StoreURLError(
            f"{location}: a store URL where a local store is written: this command writes a store to a local "
            "directory. To store it in object storage, write it locally, then `mmstore push LOCAL URL` (or write "
            "it with mmstore.ray.write); to copy a store from one URL to another, pull it to a local directory, "
            "then push it")
    return local_path(location)


def local_path(location: str | os.PathLike[str]) -> str:
    """A local location as a path: ``file://`` URLs are unwrapped;
    ``StoreURLError`` for a string that starts like an unsupported or
    malformed URL (:func:`check_location`)."""
    text = os.fspath(location)
    check_location(location)
    if isinstance(text, str) and text.lower().startswith("file://"):
        return unquote(urlsplit(text).path) or "/"
    return text


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL: ``scheme://bucket/prefix`` (``prefix`` without
    slashes at either end; the store's objects are ``prefix/<file name>``)."""

    scheme: str
    bucket: str
    prefix: str
    url: str

    @property
    def root(self) -> str:
        """The URL of the bucket (or the HTTP server's root) alone."""
        return f"{self.scheme}://{self.bucket}"

    def object_url(self, name: str) -> str:
        """The URL of the store's file ``name``."""
        return f"{self.url}/{name}"


def _check_bucket(scheme: str, bucket: str, shape: str) -> None:
    """``StoreURLError`` for a bucket (container) name no object store has."""
    if scheme == "s3" and ("@" in bucket or ":" in bucket):
        shown = bucket.rpartition("@")[2]  # never a password
        raise StoreURLError(
            f"s3://{shown}/...: an s3:// URL names the bucket alone, not the server's address, user or port: "
            "give the endpoint in AWS_ENDPOINT_URL (e.g. AWS_ENDPOINT_URL=http://HOST:9000) and the credentials in "
            f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, and the URL as {shape}")
    abfs = scheme in ("abfs", "abfss")
    if (_ABFS_CHARS if abfs else _BUCKET_CHARS).match(bucket):
        return
    odd = next(c for c in bucket if not (_ABFS_CHARS if abfs else _BUCKET_CHARS).match(c))
    what = "a space" if odd == " " else "a control character" if _CONTROL.match(odd) else repr(odd)
    kind = "container" if scheme in ("az", "azure", "abfs", "abfss") else "bucket"
    if scheme == "gs" and odd in "@:":
        hint = "; the endpoint and credentials come from the environment, not the URL"
    elif scheme in ("az", "azure") and odd in "@:":
        hint = "; the account comes from AZURE_STORAGE_ACCOUNT_NAME, not the URL"
    else:
        hint = ""
    raise StoreURLError(f"{scheme}://{bucket}/...: the {kind} name {bucket!r} holds {what}: a {kind} name is "
                        f"letters, digits, dots, hyphens and underscores{hint}: expected {shape}")


def parse_url(url: str) -> StoreURL:
    """Parse a store URL; ``StoreURLError`` (a ``ValueError``) says what is
    wrong with it and what a store URL looks like."""
    if not is_url(url):
        check_location(url)
        raise StoreURLError(f"{url!r} is not a store URL: expected one of {_supported()} (e.g. {_SHAPE})")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    web = scheme in ("http", "https")
    shape = f"{scheme}://HOST/PATH/NAME.store" if web else f"{scheme}://BUCKET/PATH/NAME.store"
    if parts.query or parts.fragment:
        raise StoreURLError(f"{url}: a store URL has no query (?...) or fragment (#...): expected {shape}")
    bucket = parts.netloc
    prefix = unquote(parts.path).strip("/")
    if not bucket:
        raise StoreURLError(f"{url}: no {'host' if web else 'bucket'}: a store URL names the "
                            f"{'server' if web else 'bucket'} and the store's path in it: expected {shape}")
    if web and "@" in bucket:
        shown = f"{scheme}://{bucket.rpartition('@')[2]}{parts.path}"  # never the password
        raise StoreURLError(f"{shown}: an http(s) store URL carries no user name or password: an http(s):// store "
                            "is read without credentials; publish its files, or use its s3:// / gs:// / az:// URL")
    if not web:
        _check_bucket(scheme, bucket, shape)
    if _CONTROL.search(url) or _CONTROL.search(prefix):
        raise StoreURLError(f"{url!r}: the URL holds a control character (a line break, a tab, or a %-escape of "
                            f"one such as %0A): expected {shape}")
    if not prefix:
        where = "a path on the server, not the server's root" if web else "a path inside the bucket, not the " \
            "bucket itself"
        raise StoreURLError(f"{url}: a store is {where}: "
                            f"expected {shape} (e.g. {scheme}://{bucket}/train.store)")
    if any(p in (".", "..") for p in prefix.split("/")) or "//" in prefix:
        raise StoreURLError(f"{url}: the path may not hold empty, '.' or '..' parts: expected {shape}")
    return StoreURL(scheme, bucket, prefix, f"{scheme}://{bucket}/{prefix}")
