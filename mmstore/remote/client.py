"""One store's objects in object storage, through obstore.

:class:`Remote` is picklable (it holds the URL only) and makes its client
lazily, once per process, so a DataLoader worker or a torchrun rank started
with spawn makes its own on first use; a process *forked* after its parent
made requests cannot use obstore at all and reads through
:mod:`mmstore.remote.forked` (NOTE [a client per process] there).

Configuration comes from the standard environment, nothing is hard-coded for
one provider. For ``s3://``: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``),
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for an S3-compatible server
(an ``http://`` endpoint allows plain HTTP), and where the keys are not in the
environment, the shared files ``~/.aws/credentials`` and ``~/.aws/config``
(``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``, profile ``AWS_PROFILE``);
otherwise obstore's own chain (instance metadata, web identity). ``gs://`` and
``az://`` read obstore's ``GOOGLE_*`` and ``AZURE_*`` variables.

Retries: every request is retried with exponential backoff and jitter on
5xx answers (``503 SlowDown`` among them), connection errors and timeouts:
``MMSTORE_REMOTE_RETRIES`` times (default 10) within
``MMSTORE_REMOTE_RETRY_TIMEOUT`` seconds (default 120); one request may take
``MMSTORE_REMOTE_TIMEOUT`` seconds (default 120). Then the request fails with a
typed error (``mmstore.errors.RemoteError`` and its kinds) naming the URL and
the object.
"""

from __future__ import annotations

import configparser
import os
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ..errors import (
    RemoteAccessError,
    RemoteChangedError,
    RemoteChecksumError,
    RemoteError,
    RemoteNotFoundError,
    RemoteUnavailableError,
)
from .index import block_digest
from .url import StoreURL, parse_url

__all__ = ["ObjectInfo", "Remote", "client_available"]

_INSTALL = "object storage needs the optional client: pip install 'mmstore[remote]' (obstore)"


def client_available() -> bool:
    """obstore can be imported."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def _obstore() -> Any:
    try:
        import obstore
        import obstore.store  # noqa: F401
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    return obstore


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected a number >= 0")
    return value


def _aws_profile_files() -> dict[str, str]:
    """Keys, region and endpoint of the AWS profile in the shared files."""
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    out: dict[str, str] = {}
    creds = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    conf = os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    for path, section in ((conf, profile if profile == "default" else f"profile {profile}"), (creds, profile)):
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError, OSError):
            continue
        if parser.has_section(section):
            for key in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token", "region", "endpoint_url"):
                if parser.has_option(section, key):
                    out[key] = parser.get(section, key).strip()
    return out


def _s3_config() -> tuple[dict[str, Any], bool]:
    """obstore S3 settings from the environment and the shared files; whether HTTP is allowed."""
    env = os.environ
    files = _aws_profile_files()
    cfg: dict[str, Any] = {}
    key = env.get("AWS_ACCESS_KEY_ID") or files.get("aws_access_key_id")
    secret = env.get("AWS_SECRET_ACCESS_KEY") or files.get("aws_secret_access_key")
    if key and secret:
        cfg["access_key_id"], cfg["secret_access_key"] = key, secret
        token = env.get("AWS_SESSION_TOKEN") if env.get("AWS_ACCESS_KEY_ID") else files.get("aws_session_token")
        if token:
            cfg["session_token"] = token
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or files.get("region") or "us-east-1"
    cfg["region"] = region
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or files.get("endpoint_url")
    allow_http = False
    if endpoint:
        cfg["endpoint"] = endpoint.rstrip("/")
        allow_http = endpoint.lower().startswith("http://")
    return cfg, allow_http


# the pid of the process whose requests made obstore's runtime (one per process,
# shared by every client): a process with another pid was forked after it
_RUNTIME_PID = [0]


class ObjectInfo(dict[str, Any]):
    """``{"size": int, "etag": str | None}`` of one object."""


class Remote:
    """The objects of one store URL. Picklable; the client is per process."""

    def __init__(self, url: str | StoreURL) -> None:
        self.loc = url if isinstance(url, StoreURL) else parse_url(url)
        self.url = self.loc.url
        self._lock = threading.Lock()
        self._client: tuple[int, Any] | None = None
        self._forked: tuple[int, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    # -- the client ---------------------------------------------------------
    def client(self) -> Any:
        """This process's client for the store's prefix, made on first use.
        A process forked after its parent made requests reads through
        :mod:`mmstore.remote.forked` instead (NOTE [a client per process]
        there): :meth:`forked` says when."""
        got = self._client
        pid = os.getpid()
        if got is not None and got[0] == pid:
            return got[1]
        with self._lock:
            got = self._client
            if got is None or got[0] != pid:
                _RUNTIME_PID[0] = _RUNTIME_PID[0] or pid
                got = (pid, self._make_client())
                self._client = got
        return got[1]

    def forked(self) -> Any:
        """The standard-library reader of a process forked after this
        process's parent ran requests through obstore, else None."""
        if not _RUNTIME_PID[0] or _RUNTIME_PID[0] == os.getpid():
            return None
        got = self._forked
        if got is not None and got[0] == os.getpid():
            return got[1]
        with self._lock:
            if self.loc.scheme != "s3":
                raise RemoteError(
                    f"{self.url}: this process was forked after its parent read from object storage, and a "
                    f"{self.loc.scheme}:// store can only be read there by a process of its own: start the "
                    "workers with spawn or forkserver (DataLoader(multiprocessing_context='spawn'))")
            from .forked import ForkedReader

            cfg, _ = _s3_config()
            reader = ForkedReader(
                self.loc.bucket, self.loc.prefix, cfg, url=self.url,
                retries=int(_env_number("MMSTORE_REMOTE_RETRIES", 10)),
                retry_timeout=_env_number("MMSTORE_REMOTE_RETRY_TIMEOUT", 120),
                timeout=_env_number("MMSTORE_REMOTE_TIMEOUT", 120),
                connect_timeout=_env_number("MMSTORE_REMOTE_CONNECT_TIMEOUT", 10))
            self._forked = (os.getpid(), reader)
        return reader

    def _refuse_forked(self, doing: str) -> None:
        if _RUNTIME_PID[0] and _RUNTIME_PID[0] != os.getpid():
            raise RemoteError(f"{self.url}: cannot {doing} from a process forked after its parent used object "
                              "storage (NOTE [a client per process] in mmstore/remote/forked.py): do it in the "
                              "parent, or start this process with spawn or forkserver")

    def _make_client(self) -> Any:
        obs = _obstore()
        retry = {
            "max_retries": int(_env_number("MMSTORE_REMOTE_RETRIES", 10)),
            "retry_timeout": timedelta(seconds=_env_number("MMSTORE_REMOTE_RETRY_TIMEOUT", 120)),
            "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15),
                        "base": 2},
        }
        options: dict[str, Any] = {
            "timeout": timedelta(seconds=_env_number("MMSTORE_REMOTE_TIMEOUT", 120)),
            "connect_timeout": timedelta(seconds=_env_number("MMSTORE_REMOTE_CONNECT_TIMEOUT", 10)),
        }
        loc = self.loc
        try:
            if loc.scheme == "s3":
                cfg, allow_http = _s3_config()
                if allow_http:
                    options["allow_http"] = True
                return obs.store.S3Store(loc.bucket, prefix=loc.prefix, config=cfg, client_options=options,
                                         retry_config=retry)
            if loc.scheme in ("http", "https"):
                options["allow_http"] = loc.scheme == "http"
                return obs.store.HTTPStore.from_url(loc.url, client_options=options, retry_config=retry)
            return obs.store.from_url(loc.url, client_options=options, retry_config=retry)
        except Exception as exc:  # noqa: BLE001 - obstore raises its own classes for configuration errors
            raise RemoteError(f"{loc.url}: cannot make an object-store client: {_first_line(exc)}; "
                              "check the URL and the AWS_* / GOOGLE_* / AZURE_* settings") from exc

    # -- requests -------------------------------------------------------------
    def error(self, exc: BaseException, name: str, doing: str) -> RemoteError:
        """The typed error for ``exc``, raised by a request about object ``name``."""
        return translate(exc, self.loc.object_url(name) if name else self.url, doing)

    def get(self, name: str) -> bytes:
        """The whole object ``name``."""
        forked = self.forked()
        if forked is not None:
            return bytes(forked.get(name))
        obs = _obstore()
        try:
            return bytes(obs.get(self.client(), name).bytes())
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            raise self.error(exc, name, "read") from exc

    def get_range(self, name: str, start: int, end: int, etag: str | None = None) -> memoryview:
        """Bytes ``[start, end)`` of object ``name``; with ``etag``, only of
        that version of it (``RemoteChangedError`` when it was replaced)."""
        forked = self.forked()
        if forked is not None:
            got: Any = forked.get(name, start, end, etag)
        else:
            got = self._get_range(name, start, end, etag)
        view = memoryview(got)
        if len(view) != end - start:
            raise RemoteChangedError(
                f"{self.loc.object_url(name)}: asked for bytes {start}-{end}, got {len(view)}: the object is "
                "shorter than the store says; it was replaced or truncated since the push: open the store again")
        return view

    def get_verified(self, name: str, start: int, end: int, etag: str | None, digest: bytes) -> tuple[memoryview, int]:
        """Bytes ``[start, end)`` of object ``name`` whose block digest is
        ``digest`` (the remote index's); fetched once more when they do not
        match, then ``RemoteChecksumError``. Returns them and how many fetches
        were repeated."""
        for attempt in (1, 2):
            data = self.get_range(name, start, end, etag)
            if block_digest(data) == digest:
                return data, attempt - 1
        raise RemoteChecksumError(
            f"{self.loc.object_url(name)}: bytes {start}-{end} do not match the digest the push recorded for them "
            "(fetched twice): the object in the bucket is damaged; push the store again from a good copy "
            "(`mmstore verify` the source first)")

    def _get_range(self, name: str, start: int, end: int, etag: str | None) -> Any:
        obs = _obstore()
        try:
            if etag:
                got = obs.get(self.client(), name, options={"range": (start, end), "if_match": etag}).bytes()
            else:
                got = obs.get_range(self.client(), name, start=start, end=end)
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            raise self.error(exc, name, f"read bytes {start}-{end} of") from exc
        return got

    def head(self, name: str) -> ObjectInfo | None:
        """Size and etag of object ``name``, or None when it does not exist."""
        self._refuse_forked("look up objects")
        obs = _obstore()
        try:
            meta = obs.head(self.client(), name)
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            err = self.error(exc, name, "look up")
            if isinstance(err, RemoteNotFoundError):
                return None
            raise err from exc
        return ObjectInfo(size=int(meta["size"]), etag=meta.get("e_tag"))

    def list(self) -> dict[str, ObjectInfo]:
        """Every object under the store's prefix: name -> size and etag."""
        self._refuse_forked("list objects")
        obs = _obstore()
        out: dict[str, ObjectInfo] = {}
        try:
            for chunk in obs.list(self.client(), None, chunk_size=1000):
                for meta in chunk:
                    out[str(meta["path"])] = ObjectInfo(size=int(meta["size"]), etag=meta.get("e_tag"))
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            err = self.error(exc, "", "list")
            if isinstance(err, RemoteNotFoundError) and "bucket" not in str(err).lower():
                return out
            raise err from exc
        return out

    def put(self, name: str, data: Any, *, size: int | None = None, chunk: int = 16 << 20,
            concurrency: int = 8) -> str | None:
        """Write object ``name`` from bytes or a binary file object (in
        parts of ``chunk`` bytes, ``concurrency`` at a time, when it is larger
        than one part); its new etag."""
        self._refuse_forked("write objects")
        obs = _obstore()
        multipart = size is not None and size > chunk
        try:
            got = obs.put(self.client(), name, data, use_multipart=multipart, chunk_size=chunk,
                          max_concurrency=concurrency)
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            raise self.error(exc, name, "write") from exc
        return got.get("e_tag") if isinstance(got, dict) else None

    def delete(self, names: Sequence[str]) -> None:
        """Delete objects ``names`` (absent ones are fine)."""
        self._refuse_forked("delete objects")
        obs = _obstore()
        for name in names:
            try:
                obs.delete(self.client(), name)
            except Exception as exc:  # noqa: BLE001 - translated to a typed error
                err = self.error(exc, name, "delete")
                if not isinstance(err, RemoteNotFoundError):
                    raise err from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # obstore's messages nest the causes; the innermost one says most
    useful = [ln for ln in lines if ln.lower().startswith(("source:", "caused by", "error"))]
    head = lines[0] if lines else text
    tail = useful[-1] if useful else ""
    out = head if not tail or tail in head else f"{head} ({tail})"
    return out[:400]


def translate(exc: BaseException, where: str, doing: str) -> RemoteError:
    """The typed mmstore error for an obstore exception about ``where``."""
    if isinstance(exc, RemoteError):
        return exc
    name = type(exc).__name__
    text = str(exc)
    low = text.lower()
    why = _first_line(exc)
    if name == "PreconditionError" or "precondition" in low or "412" in low.split("status")[-1][:8]:
        return RemoteChangedError(  # type: ignore[return-value]
            f"{where}: the object changed since the store was opened (its etag no longer matches): the store "
            "at this URL was pushed again, or the object was modified by something else; open it again "
            "(a store pushed again opens as the new one)")
    if "/latest/api/token" in low or "169.254.169.254" in low or "/latest/meta-data" in low:
        return RemoteAccessError(
            f"{where}: no credentials: none in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws, and no instance "
            "metadata service answered; set them (or AWS_PROFILE), then run again")
    if name in ("NotFoundError",) or "nosuchbucket" in low or "nosuchkey" in low or "not found" in low:
        what = "bucket" if "nosuchbucket" in low or "bucket" in low and "not" in low else "object"
        return RemoteNotFoundError(f"{where}: no such {what} ({why}); check the URL (bucket, prefix, store name)")
    if (name in ("PermissionDeniedError", "UnauthenticatedError") or "accessdenied" in low
            or "invalidaccesskeyid" in low or "signaturedoesnotmatch" in low or "forbidden" in low
            or "403" in low or "401" in low):
        return RemoteAccessError(
            f"{where}: access denied ({why}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the profile "
            "in ~/.aws), and that they may " + doing.split()[0] + " this bucket")
    return RemoteUnavailableError(
        f"{where}: could not {doing} it after retries ({why}); check the endpoint (AWS_ENDPOINT_URL), the "
        "network and the server, then run again (MMSTORE_REMOTE_RETRIES / MMSTORE_REMOTE_RETRY_TIMEOUT "
        "set how long to keep trying)")


