"""``mmstore doctor STORE``: measure, predict epoch times, advise."""

from __future__ import annotations

import argparse

from ..check.common import fmt_bytes, fmt_seconds, table
from ._common import add_common, emit_json, subparser, usage_error

EXAMPLE = """examples:
  mmstore doctor /data/landmarks.store
  mmstore doctor STORE --budget 10 --samples 128 --json

Doctor evicts the records it samples (and a range of the largest data file) from the page cache to
measure cold reads; --no-cold skips that. It finishes in about --budget seconds on any store size.
exit codes: 0 measured, 2 not a store or bad arguments
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = subparser(
        sub, "doctor", "measure disk and memory for this store, predict epoch times, advise",
        "Measure the sequential read speed of the store's files, cold and warm random record reads "
        "per second, and memory available against the store size; predict epoch 1 and 2 for a full "
        "shuffle (cold, after warm) and a block shuffle, and say what to do.",
        EXAMPLE,
    )
    add_common(p)
    p.add_argument("--samples", type=int, default=256, help="records sampled for the random reads (default 256)")
    p.add_argument("--threads", type=int, default=8, help="concurrent readers for the cold figure (default 8)")
    p.add_argument("--budget", type=float, default=30.0, metavar="SECONDS",
                   help="time bound of the measurements (default 30)")
    p.add_argument("--seq-mb", type=int, default=256, help="MB read for the sequential figure (default 256)")
    p.add_argument("--no-cold", action="store_true", help="evict nothing; skip the cold measurements")
    p.add_argument("--seed", type=int, default=0, help="seed of the record sample")
    p.add_argument("--no-codecs", action="store_true", help="skip the codec section (raw, jpeg, png, zstd compared)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..check.doctor import doctor_store

    if args.samples < 1 or args.threads < 1 or args.budget <= 0 or args.seq_mb < 1:
        return usage_error("doctor", "--samples, --threads, --budget and --seq-mb must be positive")
    rep = doctor_store(args.store, samples=args.samples, threads=args.threads, budget_s=args.budget,
                       seq_bytes=args.seq_mb << 20, cold=not args.no_cold, seed=args.seed,
                       codecs=not args.no_codecs)
    if args.json:
        emit_json(rep)
    else:
        print(render(rep))
    return 0


def render(rep) -> str:  # noqa: ANN001
    from ..check.order_advice import order_lines

    def num(x, unit=""):  # noqa: ANN001, ANN202
        return "not measured" if x is None else f"{x:,.0f}{unit}"

    d = rep.disk or {}
    kind = {"flash": "behaves like flash", "spinning": "behaves like a spinning disk",
            "between": "between flash and a spinning disk"}.get(rep.disk_kind)  # measured, not the kernel's flag
    if kind:
        from ..check.doctor import reads_text

        kind += f" ({reads_text(rep.disk_reads_per_s)} cold random reads/s from the disk, 1 reader)"
    disk = ", ".join(str(x) for x in (d.get("fs_type"), d.get("device"), kind) if x)
    out = [f"store          {rep.path} ({rep.backend}, {rep.records:,} records of {fmt_bytes(rep.record_bytes)}, "
           f"{fmt_bytes(rep.store_bytes)} of data)",
           f"disk           {disk or 'unknown'}",
           f"memory         {fmt_bytes(rep.effective_available or rep.mem_available)} available; "
           f"{fmt_bytes(rep.resident_bytes)} of the store in the page cache now",
           f"sequential     {num(rep.seq_mb_per_s, ' MB/s')} ({fmt_bytes(rep.seq_bytes)} read"
           + (", cold" if rep.seq_cold else ", partly cached" if rep.seq_cold is False else "") + ")",
           f"random, cold   {num(rep.cold_reads_per_s_1, ' records/s')} (1 reader), "
           f"{num(rep.cold_reads_per_s, ' records/s')} ({rep.cold_threads} readers); sample {rep.cold_sample}",
           f"random, warm   {num(rep.warm_reads_per_s, ' records/s')}",
           "predicted epoch times:"]
    out.append(table([[p.order, fmt_seconds(p.epoch1_s), fmt_seconds(p.epoch2_s), p.note] for p in rep.predictions],
                     header=["order", "epoch 1", "epoch 2", ""]))
    for n in rep.notes:
        out.append(f"note           {n}")
    out.append(f"advice         {rep.recommendation}")
    out += order_lines(rep.order)
    from ..check.codec_advice import render_lines

    out.extend(render_lines(rep.codecs))
    out.append(f"(measured in {rep.seconds:.1f} s)")
    return "\n".join(out)
