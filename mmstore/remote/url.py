"""Store URLs: which strings name a store in object storage, and how.

``s3://BUCKET/PREFIX/NAME.store``, ``gs://BUCKET/...``, ``az://CONTAINER/...``
(also ``azure://``, ``abfs://``), ``http://`` and ``https://`` name a store in
object storage: the objects under that prefix are the store's files, by
their names (``s3://b/train.store/manifest.json``, ...). An ``http(s)://``
URL names a store published read-only over HTTP (``https://HOST/PATH/NAME.store``:
its files at ``.../NAME.store/manifest.json``, ...), by a web server or a
bucket's public endpoint. ``file://PATH`` and a plain path name a local store,
as always.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

__all__ = ["REMOTE_SCHEMES", "StoreURL", "is_url", "local_path", "parse_url"]

REMOTE_SCHEMES = ("s3", "gs", "az", "azure", "abfs", "abfss", "http", "https")


def is_url(location: object) -> bool:
    """``location`` is a string naming a store in object storage."""
    if not isinstance(location, str):
        return False
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.lower() in REMOTE_SCHEMES


def local_path(location: str | os.PathLike[str]) -> str:
    """A local location as a path: ``file://`` URLs are unwrapped."""
    text = os.fspath(location)
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


def parse_url(url: str) -> StoreURL:
    """Parse a store URL; ``ValueError`` says what is wrong with it."""
    if not is_url(url):
        raise ValueError(f"{url!r} is not a store URL: expected one of {', '.join(s + '://' for s in REMOTE_SCHEMES)}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise ValueError(f"{url}: a store URL has no query (?...) or fragment (#...)")
    bucket = parts.netloc
    prefix = unquote(parts.path).strip("/")
    web = scheme in ("http", "https")
    if not bucket:
        raise ValueError(f"{url}: no {'host' if web else 'bucket'}: expected "
                         + (f"{scheme}://HOST/PATH/NAME" if web else f"{scheme}://BUCKET/PREFIX/NAME"))
    if web and "@" in bucket:
        shown = f"{scheme}://{bucket.rpartition('@')[2]}{parts.path}"  # never the password
        raise ValueError(f"{shown}: an http(s) store URL carries no user name or password: an http(s):// store is "
                         "read without credentials; publish its files, or use its s3:// / gs:// / az:// URL")
    if not prefix:
        where = "a path on the server, not the server's root" if web else "a prefix inside the bucket, not the " \
            "bucket itself"
        raise ValueError(f"{url}: a store is {where}: "
                         f"expected {scheme}://{bucket}/NAME (e.g. {scheme}://{bucket}/train.store)")
    if any(p in (".", "..") for p in prefix.split("/")) or "//" in prefix:
        raise ValueError(f"{url}: the prefix may not hold empty, '.' or '..' parts")
    return StoreURL(scheme, bucket, prefix, f"{scheme}://{bucket}/{prefix}")
