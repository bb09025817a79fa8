"""One small error hierarchy, rooted in the built-in exceptions.

Every mmstore error derives from :class:`MmstoreError` *and* from the built-in
exception a caller would naturally catch (``FileNotFoundError`` for a missing
or unfinished store, ``ValueError`` for bad data or arguments), so plain
``except ValueError`` clauses keep working.

A message names the file, says what was expected and what was found, and what
to do next. An option named in a message is written with :func:`spell_option`
(both spellings: Python's and the command line's); :func:`cli_wording` keeps
the command line's alone.
"""

from __future__ import annotations

import errno
import re

__all__ = [
    "AllInputsFailedError",
    "AppendMismatchError",
    "CacheFullError",
    "CacheLimitError",
    "CacheSetupError",
    "ChecksumError",
    "ClaimedSizeError",
    "DecodeError",
    "DestinationError",
    "DuplicateKeysError",
    "EntryDecodeError",
    "ForeignObjectsError",
    "FormatError",
    "GeometryError",
    "IncompleteStoreError",
    "IngestError",
    "LabelMappingError",
    "LoaderResumeError",
    "LoaderHelperError",
    "LoaderStateError",
    "LockedError",
    "MissingExtraError",
    "MmstoreError",
    "RecordIndexError",
    "RemoteAccessError",
    "RemoteChangedError",
    "RemoteChecksumError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemoteTooLargeError",
    "RemoteUnavailableError",
    "ResourceLimitError",
    "ResumeMismatchError",
    "SchemaError",
    "SourceError",
    "StateMismatchError",
    "StoreAccessError",
    "StoreChangedError",
    "StoreExistsError",
    "StoreURLError",
    "TruncatedReadError",
    "VersionError",
    "cli_wording",
    "spell_option",
]


class MmstoreError(Exception):
    """Base class of every error raised by mmstore.

    ``usage_error`` is True on the classes that mean a usage or input error
    (the caller must change the call, its options or its inputs); the
    command line exits 2 for those and 1 for every other failure."""

    usage_error = False


class FormatError(MmstoreError, ValueError):
    """A store on disk does not match the format: garbled manifest, wrong
    file size, wrong dtype, missing field file, unsafe names."""


class VersionError(FormatError):
    """The store was written by a format version this mmstore cannot read."""


class ChecksumError(FormatError):
    """A record's bytes do not match its stored checksum."""


class EntryDecodeError(FormatError):
    """A stored entry of an encoded field does not decode to its field's dtype and shape.

    The message names the field, index, slot and key where the reader knows
    them; ``mmstore verify --decode`` lists every such entry. It also carries
    them as attributes, None where unknown: ``field``, ``slot``, ``index``
    (None for a hole too), ``key`` and ``reason`` (why, without the place;
    else the message). Offsets that do not form an increasing pair within
    the data file raise it too.
    """

    def __init__(self, message: str, *, field: str | None = None, slot: int | None = None,
                 index: int | None = None, key: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.slot = slot
        self.index = index
        self.key = key
        self.reason = message if reason is None else reason


class StoreChangedError(FormatError):
    """A store's files were replaced, truncated or removed after it was opened
    (for example by ``ingest --overwrite`` at the same path): a ``Store``
    reads the store it opened or raises this, never the new files."""


class TruncatedReadError(StoreChangedError, OSError, EOFError):
    """A read of a store file hit its end before the bytes the store says
    are there: the file was truncated (or replaced by a shorter one) after
    the store was opened. Also an :class:`OSError` (``errno.EIO``,
    ``filename`` set) and an :class:`EOFError`; attributes ``offset``,
    ``expected``, ``received`` (bytes) and ``file_size`` (None if unknown)."""

    def __init__(self, filename: str, offset: int, expected: int, received: int, file_size: int | None) -> None:
        size = "unknown" if file_size is None else f"{file_size:,}"
        msg = (f"expected {expected:,} bytes at file offset {offset:,} but got only {received:,} before the end "
               f"of the file (file size {size}): it was truncated or replaced after the store was opened; run "
               "mmstore verify on the store, and reopen it once it is whole")
        OSError.__init__(self, errno.EIO, msg, filename)
        self.offset = offset
        self.expected = expected
        self.received = received
        self.file_size = file_size

    def __str__(self) -> str:
        return OSError.__str__(self)


class StoreAccessError(MmstoreError, PermissionError):
    """A store file cannot be read for lack of permission."""


class IncompleteStoreError(MmstoreError, FileNotFoundError):
    """No store here, or one whose ingest did not finish (no manifest)."""

    usage_error = True


class StoreExistsError(MmstoreError, FileExistsError):
    """The destination already holds a store (pass ``overwrite=True``), or an
    unfinished ingest (pass ``resume=True`` or ``overwrite=True``). The
    command line's exit code 2: the user chooses."""

    usage_error = True


class ForeignObjectsError(StoreExistsError):
    """A push (or a Ray write) to a URL whose prefix holds objects that are
    not the store's own: another store, a README, anything that no store's
    index at that URL lists. A push never deletes or overwrites them, with
    or without ``overwrite``; the message names a few of them and their
    count, and says what to do (push to a prefix of the store's own)."""


class DestinationError(MmstoreError, ValueError):
    """A destination mmstore may not write or replace: not an mmstore store
    (or ``.partial``), a symbolic link, or a folder that is, contains or lies
    inside one of the inputs. Nothing was changed. The command line's exit
    code 2."""

    usage_error = True


class LockedError(MmstoreError, BlockingIOError):
    """Another live process is writing to the same destination."""


class SchemaError(MmstoreError, ValueError):
    """A sample or schema does not fit: unknown field, wrong shape, lossy
    cast, an unknown codec. The command line's exit code 2."""

    usage_error = True


class DecodeError(MmstoreError, ValueError):
    """An input could not be decoded into a record.

    ``reason`` is a short, stable string whose first word is a category
    (``empty``, ``not-an-image``, ``truncated``, ``corrupt``, ``too-large``,
    ``unreadable``, ``wrong-shape``, ``unsupported``; ``bad-label`` for a
    list row whose label cell is blank or invalid).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GeometryError(MmstoreError, ValueError):
    """Points or boxes cannot be mapped between source and stored pixels: a
    transform that is not one, or a store whose records lack ``dst`` and whose
    provenance cannot derive it (see :mod:`mmstore.decode.geometry`)."""


class IngestError(MmstoreError, RuntimeError):
    """An ingest stopped (too many errors, a worker died, disk full ...);
    the ``.partial`` directory is kept so the run can resume."""


class SourceError(IngestError, ValueError):
    """The source or the options of an ingest (or merge) cannot be used: no
    such source, a needed option missing (a target size for encoded images),
    a column or array that is not there, a malformed list or annotation
    file, no inputs at all, parts that do not belong together. Raised before
    any record is written. The command line's exit code 2."""

    usage_error = True


class AppendMismatchError(SourceError):
    """An option given to an append (``mmstore append``, ``mmstore.append``)
    differs from the store's own (its size, resize, codecs, backend, ...), or
    the new records' schema or labels do not fit the store's: the message
    names each difference. Nothing is written."""


class DuplicateKeysError(SourceError):
    """New records of an append would repeat keys of the store's records;
    ``duplicate_keys="keep"`` (``--duplicate-keys keep``) appends them anyway."""


class MissingExtraError(MmstoreError, ImportError):
    """An optional dependency that this use needs is not installed; the
    message says which ``pip install`` adds it."""

    usage_error = True


class AllInputsFailedError(IngestError):
    """Every input of an ingest failed: not one record was made.

    Nothing is published: no manifest is written and ``DEST``, if it
    existed, is unchanged. ``DEST.partial`` is kept with an
    ``errors.jsonl`` (slot, key, reason of every failure; same lines as a
    store's). Attributes: ``failed`` (the count), ``reasons`` (a
    ``Counter`` of reasons), ``key`` (an input that failed for the most
    common reason) and ``errors_path``."""

    def __init__(self, message: str, failed: int = 0, reasons: dict[str, int] | None = None, key: str | None = None,
                 errors_path: str | None = None) -> None:
        super().__init__(message)
        self.failed = failed
        self.reasons = reasons
        self.key = key
        self.errors_path = errors_path


class ResumeMismatchError(IngestError, ValueError):
    """A resume was asked with inputs or parameters that differ from the
    interrupted run's (the fingerprint in the ``.partial`` does not match).
    The message names what changed. The command line's exit code 2."""

    usage_error = True


class ResourceLimitError(MmstoreError, OSError):
    """The process ran out of a resource the operating system limits (open
    files: a merged store of many segments maps one file per field and
    segment); the message names the limit and how to raise it."""


class LoaderStateError(MmstoreError, RuntimeError):
    """A :class:`mmstore.torch.Loader` was used in a way its state does not
    allow: a second epoch started while one is still being iterated, two
    threads calling ``next()`` on one iterator at once, an iterator continued
    after ``Loader.close()`` or in a forked process. The message says how to
    end the epoch in progress or start a new one."""


class LoaderHelperError(LoaderStateError):
    """The helper process of a ``Loader(process=True)`` stopped (killed, out
    of memory, a crash) or could not start, or raised an error that could
    not be sent back as it was; the epoch in progress ended, and the next
    ``iter(loader)`` starts a new helper. The message gives its pid, how it
    ended, and the error it raised when there was one."""


class StateMismatchError(MmstoreError, ValueError):
    """A ``state_dict`` was loaded into an object it was not taken from: a
    sampler (or loader) over another dataset length, order kind, seed, rank
    split or batch size. Nothing was changed; the message names the first
    difference."""


class LabelMappingError(MmstoreError, ValueError):
    """An ingest was given a class-name -> label mapping (``--classes-from``,
    ``--label-names``) that does not cover the source's classes; the message
    lists the classes that are missing from the mapping. The command
    line's exit code 2."""

    usage_error = True


class LoaderResumeError(LoaderStateError, StateMismatchError):
    """``Loader.load_state_dict`` was given a state this loader cannot
    resume: another store, subset, batch size or order, or an unknown state
    version. The message names the key that differs, both values, and what
    to build instead."""


class RecordIndexError(MmstoreError, IndexError):
    """A record index given to the torch layer (``Loader(indices=...)``, a
    ``Subset``) is outside the store, or not an integer; the message gives
    the first bad index and the store's length."""


class RemoteError(MmstoreError, OSError):
    """A request to object storage failed (``s3://``, ``gs://``, ``az://``,
    ``http(s)://`` stores). The message names the URL and the object, what the
    server or the network answered, and what to check."""


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The bucket, the store or one of its objects does not exist at the URL
    (or a store there was not pushed completely: no manifest yet)."""

    usage_error = True


class RemoteAccessError(RemoteError, PermissionError):
    """The object store refused the credentials (missing, wrong, expired) or
    they do not allow the request."""

    usage_error = True


class RemoteUnavailableError(RemoteError, ConnectionError):
    """The object store did not answer usably (connection refused or reset,
    timeouts, throttling or server errors) after every retry."""


class RemoteChangedError(StoreChangedError):
    """The store at a URL changed after it was opened or cached (a new push:
    another manifest, other objects); nothing of the two is mixed. Open it
    again to read the new one."""


class CacheFullError(MmstoreError, OSError):
    """The disk under the cache of a store opened from a URL is full
    (``ENOSPC``): the message names the cache directory, the bytes the
    cache needed, its ``cache_limit``, and what to do (free space on that
    disk, set a smaller ``cache_limit``, or use another ``cache_dir``)."""


class CacheSetupError(MmstoreError, OSError):
    """The files of the cache of a store opened from a URL could not be
    created (a file larger than its file system takes, a directory that
    cannot be written, ...): the message names the cache directory, what the
    system answered, and what to do; ``errno`` is the system's."""


class RemoteTooLargeError(FormatError):
    """A file of a store in object storage that is read whole
    (``manifest.json``, ``_remote.json``) is larger than such a file may be:
    refused before more than its limit was downloaded. Attributes ``size``
    (the object's bytes, as far as known) and ``limit``."""

    def __init__(self, message: str, size: int = 0, limit: int = 0) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class ClaimedSizeError(FormatError):
    """A store's manifest (and its remote index) claims a size for one of
    its files that its schema and slot count do not give: refused before
    any file is created at that size. Attributes ``name``, ``claimed`` and
    ``expected`` (bytes)."""

    def __init__(self, message: str, name: str = "", claimed: int = 0, expected: int = 0) -> None:
        super().__init__(message)
        self.name = name
        self.claimed = claimed
        self.expected = expected


class StoreURLError(MmstoreError, ValueError):
    """A store location that is a malformed or unsupported URL: no bucket or
    no store path (``s3://bucket``), a scheme mmstore does not read
    (``ftp://``), a URL with one slash (``s3:/bucket/x``). Never taken as a
    local path. The command line's exit code 2."""

    usage_error = True


class CacheLimitError(MmstoreError, ValueError):
    """A ``cache_limit`` too small for the order to read from a URL: it
    could not hold what the epoch keeps at once without fetching a block
    twice. The message gives the smallest limit that works (and the
    sizes it works with). The command line's exit code 2."""

    usage_error = True


class RemoteChecksumError(ChecksumError):
    """Bytes fetched from object storage do not match the digest the push
    recorded for them, twice: the object in the bucket is damaged (or was
    written by something else than ``mmstore push``)."""


# -- options named in messages ---------------------------------------------------------

_SPELLED = re.compile(r"`([^`]*)` \(CLI: `([^`]*)`\)")


def spell_option(python: str, cli: str) -> str:
    """An option named in a message, in both spellings: ``spell_option("size=(H, W)",
    "--size HxW")`` is the Python spelling in backquotes followed by
    ``(CLI: --size HxW)`` with the command line's in backquotes; the command
    line prints ``--size HxW`` alone (:func:`cli_wording`)."""
    return f"`{python}` (CLI: `{cli}`)"


def cli_wording(message: str) -> str:
    """``message`` as the command line prints it: each option written by
    :func:`spell_option` in its command-line spelling alone."""
    return _SPELLED.sub(r"\2", message)
