"""Ingest options: the one list of decode, source and run option names with the defaults, their parsers, and the
resume hint."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import Any

import numpy as np

from ..decode import DecodeSpec
from ..errors import spell_option

__all__ = [
    "DEFAULT_RESUME_HINT",
    "RUN_DEFAULTS",
    "SIZE_OPTIONS",
    "SOURCE_OPTIONS",
    "SPEC_DEFAULTS",
    "SPEC_OPTIONS",
    "ErrorLimit",
    "ResumeHint",
    "kept_message",
    "check_size_options",
    "make_spec",
    "parse_max_errors",
    "parse_side",
    "parse_shard",
    "parse_size",
    "resume_advice",
    "shard_from_env",
    "shard_range",
    "split_options",
]

# keyword options of mmstore.ingest.ingest() that shape the decode: the fields of DecodeSpec after its size, in its
# order; their defaults are its field defaults (make_spec, the CLI's flags and so the fingerprint read them here) ...
SPEC_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {f.name: f.default for f in fields(DecodeSpec) if f.name not in ("size", "buckets")})
SPEC_OPTIONS: tuple[str, ...] = tuple(SPEC_DEFAULTS)
# ... and those that describe the source (see sources.detect_source); the CLI's flags are these names
SOURCE_OPTIONS: tuple[str, ...] = ("labels", "root", "path_column", "label_column", "path_template", "delimiter",
                                   "header", "label_type", "missing_label", "image_key", "label_key", "classes_from",
                                   "label_names", "new_classes")
SOURCE_OPTIONS += ("min_box_size",)  # COCO (mmstore.ingest.coco)

# ... the keyword options that say, instead of size, that records keep each image's own aspect or go to the
# nearest of a few shapes (make_spec)
SIZE_OPTIONS: tuple[str, ...] = ("max_side", "short_side", "buckets")

DEFAULT_RESUME_HINT = f"rerun the same ingest with {spell_option('resume=True', '--resume')}"
SOURCE_OPTIONS += ("tags_column", "tags_sep", "text_column", "tag_names")  # a list's tags and captions (_tags.py)
SOURCE_OPTIONS += ("json_keys",)  # WebDataset tar shards (webdataset.py)
SOURCE_OPTIONS += ("image_column", "caption_column", "columns")  # Parquet files, HF datasets (parquet.py, hf.py)

# ... and the keyword options of ingest() that shape the run, with their defaults (the CLI's flags read them here;
# backend, codecs and shard enter the resume fingerprint)
RUN_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "workers": None,  # the usable CPU cores (workers.default_workers)
    "on_error": "skip",
    "max_errors": None,  # no limit
    "resume": False,
    "overwrite": False,
    "shard": None,  # every input
    "quiet": False,
    "backend": "memmap",
    "codecs": None,  # every field raw
    "chunk": None,  # chosen by the run (schedule.chunk_size)
    "progress_interval": 10.0,
    "resume_hint": None,  # then DEFAULT_RESUME_HINT
})

# how a caller says how to resume: a text, or a function of the options a resume must change (option -> value)
ResumeHint = str | Callable[[Mapping[str, str]], str] | None


def resume_advice(hint: ResumeHint, changes: Mapping[str, str] | None = None) -> str:
    """How to continue a stopped ingest: ``hint`` (None: :data:`DEFAULT_RESUME_HINT`)
    with ``changes`` (option name -> the value a resume needs, e.g. a raised
    ``max_errors``); a function ``hint`` is called with ``changes``."""
    changes = dict(changes or {})
    if callable(hint):
        return hint(changes)
    text = hint or DEFAULT_RESUME_HINT
    if not changes:
        return text
    return text + ", with " + " and ".join(spell_option(f"{k}={v!r}", f"--{k.replace('_', '-')} {v}")
                                           for k, v in changes.items())


def kept_message(partial: str, hint: ResumeHint = None, changes: Mapping[str, str] | None = None) -> str:
    """What a stopped ingest says about its kept work and how to continue it;
    ``changes``: the run stopped at its error limit, which a resume must raise."""
    if changes:
        return (f"the work done so far is kept in {partial}; the same command would stop again: raise the limit to "
                f"continue ({resume_advice(hint, changes)})")
    return f"the work done so far is kept in {partial}; {resume_advice(hint)} to continue"


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` as (decode options, source options); unknown names are a TypeError."""
    unknown = set(options) - set(SPEC_OPTIONS) - set(SOURCE_OPTIONS)
    if unknown:
        raise TypeError(f"unknown ingest option(s): {sorted(unknown)}")
    spec_kw = {k: options[k] for k in SPEC_OPTIONS if k in options}
    src_kw = {k: options[k] for k in SOURCE_OPTIONS if k in options}
    return spec_kw, src_kw


def make_spec(size: Any = None, *, max_side: Any = None, short_side: Any = None, buckets: Any = None,
              **options: Any) -> DecodeSpec | None:
    """A :class:`mmstore.decode.DecodeSpec` from ingest options (None without a size).

    ``options`` are decode options (:data:`SPEC_OPTIONS`); one not given, and
    ``max_pixels=None``, takes its :data:`SPEC_DEFAULTS` value (the field
    default of ``DecodeSpec``). An option whose default is a bool or an int
    is converted with ``bool()`` / ``int()``. An unknown name is a TypeError.

    ``max_side=N`` / ``short_side=N`` instead of ``size``: records keep each
    image's own aspect, its long (short) side ``N`` (``resize="max-side"`` /
    ``"short-side"``; ``upscale=True`` enlarges smaller images too). At most
    one of ``size``, ``max_side`` and ``short_side`` may be given
    (:class:`~mmstore.errors.SourceError` otherwise, saying which to pick),
    and ``resize`` goes with ``size`` alone.

    ``buckets`` instead of ``size``: aspect buckets (``resize="buckets"``):
    ``"auto"``, ``"auto:N"``, ``"HxW,HxW,..."`` or a list of ``(h, w)``
    pairs (:func:`mmstore.decode.buckets.parse_buckets`; a list that does
    not parse is a ``ValueError`` saying the expected form). It excludes
    ``size``, ``max_side``, ``short_side``, ``resize``, ``upscale`` and
    ``layout="chw"`` (:class:`~mmstore.errors.SourceError`).
    """
    unknown = set(options) - set(SPEC_DEFAULTS)
    if unknown:
        raise TypeError(f"make_spec() got unknown decode option(s): {sorted(unknown)}")
    if buckets is not None:
        return _bucket_spec(size, max_side, short_side, buckets, options)
    side_policy = check_size_options(size, max_side, short_side, options.get("resize"), options.get("upscale"))
    if side_policy is not None and options.get("layout") == "chw":
        from ..errors import SourceError

        side = "max_side" if side_policy == "max-side" else "short_side"
        raise SourceError(f"{spell_option(side + '=N', '--' + side.replace('_', '-') + ' N')} keeps each image's own "
                          f"shape, stored as (h, w, C): {spell_option('layout=' + repr('chw'), '--layout chw')} "
                          "is for records of one fixed shape (leave it out; permute the channels at training time)")
    if side_policy is not None:
        n = parse_side(max_side if side_policy == "max-side" else short_side,
                       "max_side" if side_policy == "max-side" else "short_side")
        options = {**options, "resize": side_policy}
        hw: tuple[int, int] | None = (n, n)
    else:
        hw = parse_size(size)
    if hw is None:
        return None
    return DecodeSpec(size=hw, **_spec_kw(options))


def _bucket_spec(size: Any, max_side: Any, short_side: Any, buckets: Any, options: dict[str, Any]) -> DecodeSpec:
    """``make_spec`` with ``buckets``: the option conflicts first, then the list."""
    from ..decode.buckets import parse_buckets
    from ..errors import SourceError

    flag = spell_option("buckets=...", "--buckets ...")
    named = (("size=(H, W)", "--size HxW"), ("max_side=N", "--max-side N"), ("short_side=N", "--short-side N"))
    given = [spell_option(*f) for v, f in zip((size, max_side, short_side), named) if v is not None]
    if given:
        auto = spell_option("buckets=" + repr("auto:N"), "--buckets auto:N")
        raise SourceError(f"{flag} and {' and '.join(given)} exclude each other: the buckets are the sizes of the "
                          f"records (for buckets of about N x N pixels chosen from the data: {auto})")
    resize = options.get("resize")
    if resize not in (None, SPEC_DEFAULTS["resize"], "buckets"):
        raise SourceError(f"{spell_option(f'resize={resize!r}', f'--resize {resize}')} goes with "
                          f"{spell_option('size=(H, W)', '--size HxW')}; with {flag} every image is resized to cover "
                          "its bucket and centre-cropped (leave the resize option out)")
    if options.get("upscale"):
        raise SourceError(f"{spell_option('upscale=True', '--upscale')} goes with --max-side/--short-side; with {flag} "
                          "every image is resized to its bucket, enlarged when smaller (leave it out)")
    if options.get("layout") == "chw":
        raise SourceError(f"{flag} stores each record at its bucket's shape, as (h, w, C): "
                          f"{spell_option('layout=' + repr('chw'), '--layout chw')} is for records of one fixed shape "
                          "(leave it out; permute the channels at training time)")
    channels = int(options.get("channels") or SPEC_DEFAULTS["channels"])
    parsed = parse_buckets(buckets, channels)
    return DecodeSpec(size=(1, 1), buckets=parsed, **_spec_kw({**options, "resize": "buckets"}))


def _spec_kw(options: dict[str, Any]) -> dict[str, Any]:
    """The decode options given over ``SPEC_DEFAULTS``, each of the default's
    type (``max_pixels=None``: the default)."""
    kw = {**SPEC_DEFAULTS, **options}
    if kw["max_pixels"] is None:
        kw["max_pixels"] = SPEC_DEFAULTS["max_pixels"]
    for name, default in SPEC_DEFAULTS.items():
        if isinstance(default, bool):
            kw[name] = bool(kw[name])
        elif isinstance(default, int):
            kw[name] = int(kw[name])
    return kw


def check_size_options(size: Any, max_side: Any, short_side: Any, resize: Any = None,
                       upscale: Any = None) -> str | None:
    """The aspect-kept policy (``"max-side"`` / ``"short-side"``) the size
    options ask for, or None for ``size`` (or nothing). Refuses
    (:class:`~mmstore.errors.SourceError`) more than one of them, ``resize``
    with an aspect-kept one, and ``upscale`` without one."""
    from ..errors import SourceError

    given = [name for name, v in (("size", size), ("max_side", max_side), ("short_side", short_side))
             if v is not None]
    flag = {"size": ("size=(H, W)", "--size HxW"), "max_side": ("max_side=N", "--max-side N"),
            "short_side": ("short_side=N", "--short-side N")}
    if len(given) > 1:
        raise SourceError(
            f"{' and '.join(spell_option(*flag[g]) for g in given)} exclude each other: pick one: "
            f"{spell_option(*flag['size'])} for records of one fixed shape (cropped or padded per "
            f"{spell_option('resize=', '--resize')}), {spell_option(*flag['max_side'])} to keep each image's aspect "
            f"with its long side at most N, or {spell_option(*flag['short_side'])} for its short side N")
    policy = {"max_side": "max-side", "short_side": "short-side"}.get(given[0]) if given else None
    if policy is not None and resize not in (None, SPEC_DEFAULTS["resize"], policy):
        raise SourceError(f"{spell_option(f'resize={resize!r}', f'--resize {resize}')} goes with "
                          f"{spell_option(*flag['size'])}; {spell_option(*flag[given[0]])} keeps each image's whole "
                          "picture at its own aspect (leave the resize option out)")
    if upscale and policy is None:
        raise SourceError(f"{spell_option('upscale=True', '--upscale')} enlarges images smaller than "
                          f"{spell_option(*flag['max_side'])} or {spell_option(*flag['short_side'])}; "
                          f"with {spell_option(*flag['size'])} every image is resized to it anyway (leave it out)")
    return policy


def parse_side(value: Any, name: str) -> int:
    """A side ``N`` of ``max_side`` / ``short_side``: a positive int (or its text)."""
    v = value
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v.strip())
    if not _is_int(v) or int(v) < 1:
        raise ValueError(f"{spell_option(name + '=N', '--' + name.replace('_', '-') + ' N')} takes a positive "
                         f"number of pixels, such as 256; got {value!r}")
    return int(v)


def parse_size(text: str | int | tuple[int, int] | None) -> tuple[int, int] | None:
    """The target size ``(h, w)`` of an ingest, or None.

    ``(h, w)`` (a pair of ints), ``"HxW"`` (``"224x224"``, also ``"224*224"``),
    or one number, ``224`` or ``"224"``, for a square ``224 x 224`` (as
    torchvision's and timm's sizes read). Each side must be a positive int:
    anything else raises ``ValueError`` (``TypeError`` for a value of another
    type) saying what is accepted.
    """
    if text is None:
        return None
    parts: list[Any]
    if isinstance(text, str):
        s = text.strip().lower().replace("*", "x")
        try:
            parts = [int(v) for v in (s.split("x") if "x" in s else (s, s))]
        except ValueError:
            raise ValueError(f"size must be {_SIZE_RULE}; got {text!r}") from None
    elif isinstance(text, (tuple, list)):
        parts = list(text)
    elif _is_int(text):
        parts = [text, text]
    else:
        raise TypeError(f"size must be {_SIZE_RULE}; got {type(text).__name__} {text!r}")
    if len(parts) != 2 or not all(_is_int(v) and v > 0 for v in parts):
        raise ValueError(f"size must be {_SIZE_RULE}; got {text!r}")
    return int(parts[0]), int(parts[1])


_SIZE_RULE = spell_option("an int N (for N x N) or an (H, W) pair of positive ints",
                          "HxW such as 224x224, or N for NxN")


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def shard_from_env(env: Any = None) -> tuple[int, int]:
    """The shard ``(K, N)`` a launcher gave this process (``--shard auto``).

    ``RANK`` / ``WORLD_SIZE`` (torchrun, ``torch.distributed.run``) first;
    else a SLURM job array: ``K = (SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN)
    // SLURM_ARRAY_TASK_STEP`` (MIN 0 and STEP 1 when unset) and ``N =
    SLURM_ARRAY_TASK_COUNT``. ValueError when neither is set, when the values
    do not make a shard (an array with gaps, seen from
    ``SLURM_ARRAY_TASK_MAX``: pass ``--shard K/N``), or when torchrun of
    several processes runs inside an array of several tasks (both set: each
    array task would ingest the same parts; with one torchrun process per
    task the array numbers the parts).
    """
    env = os.environ if env is None else env

    def num(name: str, default: int | None = None) -> int:
        v = env.get(name)
        if v is None or v == "":
            if default is None:
                pair = "RANK and WORLD_SIZE" if name in ("RANK", "WORLD_SIZE") else "SLURM_ARRAY_TASK_ID and _COUNT"
                raise ValueError(f"--shard auto: {name} is not set (a launcher sets {pair} together); pass "
                                 "--shard K/N explicitly")
            return default
        try:
            return int(v)
        except ValueError:
            raise ValueError(f"--shard auto: {name}={v!r} is not an integer; pass --shard K/N explicitly") from None

    torchrun = env.get("RANK") not in (None, "") or env.get("WORLD_SIZE") not in (None, "")
    array = env.get("SLURM_ARRAY_TASK_ID") not in (None, "") and num("SLURM_ARRAY_TASK_COUNT", 1) > 1
    if torchrun and array and (num("RANK"), num("WORLD_SIZE")) == (0, 1):
        torchrun = False  # torchrun of one process in each array task: the array numbers the parts
    if torchrun and array:
        raise ValueError(
            f"--shard auto: both RANK/WORLD_SIZE (torchrun, {env.get('RANK')}/{env.get('WORLD_SIZE')}) and a SLURM "
            f"array (task {env.get('SLURM_ARRAY_TASK_ID')} of {env.get('SLURM_ARRAY_TASK_COUNT')}) are set: taking "
            "either alone would make every array task ingest the same parts; pass --shard K/N explicitly (e.g. "
            "K = array_index * WORLD_SIZE + RANK, N = array_count * WORLD_SIZE)"
        )
    if torchrun:
        k, n, src = num("RANK"), num("WORLD_SIZE"), "RANK/WORLD_SIZE"
    elif env.get("SLURM_ARRAY_TASK_ID") not in (None, ""):
        tid, lo, step = num("SLURM_ARRAY_TASK_ID"), num("SLURM_ARRAY_TASK_MIN", 0), num("SLURM_ARRAY_TASK_STEP", 1)
        n, src = num("SLURM_ARRAY_TASK_COUNT"), "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT"
        if step < 1 or (tid - lo) % step:
            raise ValueError(f"--shard auto: SLURM_ARRAY_TASK_ID={tid} is not SLURM_ARRAY_TASK_MIN={lo} plus a "
                             f"multiple of SLURM_ARRAY_TASK_STEP={step}; pass --shard K/N explicitly")
        hi = num("SLURM_ARRAY_TASK_MAX", -1)
        if hi >= lo and (hi - lo) // step + 1 != n:
            raise ValueError(f"--shard auto: the SLURM array {lo}-{hi}:{step} has gaps ({n} tasks, not "
                             f"{(hi - lo) // step + 1}; an index list such as --array=1,3,5?), so its task ids do "
                             "not number the parts; pass --shard K/N explicitly")
        k = (tid - lo) // step
    else:
        raise ValueError(
            "--shard auto: no launcher told this process its part: neither RANK/WORLD_SIZE (torchrun) nor "
            "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT (sbatch --array) is set; pass --shard K/N (K from 0)"
        )
    if not (n >= 1 and 0 <= k < n):
        why = "" if torchrun else " (an array with gaps or an offset without SLURM_ARRAY_TASK_MIN?)"
        raise ValueError(f"--shard auto: {src} give part {k} of {n}, which is not in [0, {n}){why}; pass "
                         "--shard K/N explicitly")
    return k, n


def parse_shard(text: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"K/N"`` (0 <= K < N) -> ``(K, N)``; ``"auto"``: :func:`shard_from_env`."""
    if text is None:
        return None
    if isinstance(text, str) and text.strip().lower() == "auto":
        return shard_from_env()
    if isinstance(text, (tuple, list)):
        k, n = (int(v) for v in text)
    else:
        try:
            k_s, n_s = str(text).split("/")
            k, n = int(k_s), int(n_s)
        except ValueError:
            raise ValueError(f"--shard must be K/N such as 0/8, or auto, got {text!r}") from None
    if not (n >= 1 and 0 <= k < n):
        raise ValueError(f"--shard K/N needs 0 <= K < N (K counts from 0), got {k}/{n}")
    return k, n


def shard_range(n: int, shard: tuple[int, int] | None) -> tuple[int, int]:
    """The input range ``[lo, hi)`` of shard ``(K, N)`` of ``n`` inputs (all of them for None)."""
    if shard is None:
        return 0, n
    k, m = shard
    return k * n // m, (k + 1) * n // m


def parse_max_errors(text: str | int | float | None) -> tuple[str, float] | None:
    """``"10"`` -> ("count", 10); ``"1.5%"`` -> ("percent", 1.5); None: no limit."""
    if text is None:
        return None
    s = str(text).strip()
    try:
        if s.endswith("%"):
            v = float(s[:-1])
            if not 0 <= v <= 100:
                raise ValueError
            return "percent", v
        v = int(s)
        if v < 0:
            raise ValueError
        return "count", float(v)
    except ValueError:
        raise ValueError(f"--max-errors must be a count N or a percentage P%, got {text!r}") from None


class ErrorLimit:
    """``--on-error`` / ``--max-errors`` as one rule: how many failed inputs stop a run."""

    def __init__(self, on_error: str, max_errors: str | int | None) -> None:
        if on_error not in ("skip", "fail"):
            raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
        self.on_error = on_error
        self.limit = ("count", 0.0) if on_error == "fail" else parse_max_errors(max_errors)

    def exceeded(self, nerr: int, slots: int) -> bool:
        """True when ``nerr`` failed inputs of ``slots`` are more than allowed."""
        if self.limit is None:
            return False
        kind, v = self.limit
        return nerr > (v if kind == "count" else v / 100.0 * slots)

    def raised(self, nerr: int) -> dict[str, str]:
        """The options (name -> value) of a resume that goes on past the
        ``nerr`` failed inputs that stopped a run: ``on_error`` skip and a
        ``max_errors`` at least twice the limit reached."""
        kind, v = self.limit  # type: ignore[misc]
        out = {"on_error": "skip"} if self.on_error == "fail" else {}
        if kind == "percent":
            out["max_errors"] = f"{min(100.0, max(2 * v, 1.0)):g}%"
        else:
            out["max_errors"] = str(max(2 * nerr, 10))
        return out

    def message(self, nerr: int, reasons: Any) -> str:
        kind, v = self.limit  # type: ignore[misc]
        lim = f"{int(v)}" if kind == "count" else f"{v:g}%"
        top = "; ".join(f"{c}x {r}" for r, c in reasons.most_common(3))
        why = ("--on-error fail stops at the first" if self.on_error == "fail"
               else f"more than --max-errors {lim} allows")
        return f"stopped: {nerr} inputs failed ({why}); most common: {top}"
