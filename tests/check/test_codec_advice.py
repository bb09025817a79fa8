"""doctor's codec section: the advice as a pure function of measured numbers
(hypothesis), the measurement on a store's own records, and the CLI."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.images import photo
from support.proc import run_cli, run_json

import mmstore
from mmstore.check.codec_advice import (
    FIT_SHARE,
    QUALITY_SLACK,
    CodecFigure,
    Machine,
    advise,
    codec_advice,
    measure_codecs,
    predict,
)
from mmstore.check.common import sample_indices

RAW_BYTES = 150_536  # a 224x224x3 image + an int64 label


def fig(codec, record_bytes, decode_ms, lossless=None):
    lossless = codec != "jpeg" and not codec.startswith("jpeg:") if lossless is None else lossless
    return CodecFigure(codec, float(record_bytes), RAW_BYTES / record_bytes, 1.0, decode_ms, lossless, 32)


rates = st.floats(1e-3, 50.0)  # ms per record, one core
machines = st.builds(
    Machine,
    records=st.integers(1, 20_000_000),
    available=st.one_of(st.none(), st.integers(0, 2**41)),
    seq_bytes_per_s=st.one_of(st.none(), st.floats(1e6, 2e10)),
    cores=st.integers(1, 128),
)


@st.composite
def figure_sets(draw):
    """raw and any of the other candidates, with any sizes and decode costs."""
    figs = [fig("raw", RAW_BYTES, draw(st.floats(1e-3, 1.0)))]
    for name in draw(st.sets(st.sampled_from(["jpeg:90", "jpeg:95", "png:1", "zstd:3"]))):
        figs.append(fig(name, draw(st.floats(500, RAW_BYTES * 1.2)), draw(rates)))
    return figs


@settings(max_examples=300, deadline=None)
@given(m=machines, figs=figure_sets())
def test_a_store_that_fits_raw_gets_raw(m, figs):
    preds, choice, why = advise(m, figs)
    raw = preds[0]
    assert raw.codec == "raw" and raw.store_bytes == m.records * RAW_BYTES
    if m.available is not None and m.records * RAW_BYTES <= FIT_SHARE * m.available:
        assert raw.fits and choice == "raw" and "fits in the memory available" in why
    assert choice in {f.codec for f in figs}


@settings(max_examples=300, deadline=None)
@given(m=machines, figs=figure_sets(), more=st.integers(0, 2**41))
def test_more_ram_never_flips_a_fitting_raw_store(m, figs, more):
    m.available = max(m.available or 0, int(np.ceil(m.records * RAW_BYTES / FIT_SHARE)))  # raw fits
    assert advise(m, figs)[1] == "raw"
    m.available += more
    assert advise(m, figs)[1] == "raw"


@settings(max_examples=300, deadline=None)
@given(m=machines, jpeg_bytes=st.floats(2_000, 40_000), jpeg_ms=rates, raw_ms=st.floats(1e-3, 1.0),
       others=figure_sets())
def test_does_not_fit_raw_fits_jpeg_gets_jpeg_when_decode_beats_the_disk(m, jpeg_bytes, jpeg_ms, raw_ms, others):
    m.seq_bytes_per_s = m.seq_bytes_per_s or 150e6
    S_raw, S_jpeg = m.records * RAW_BYTES, m.records * jpeg_bytes
    m.available = int((S_jpeg / FIT_SHARE + S_raw / FIT_SHARE) / 2)  # between the two
    if not (S_jpeg <= FIT_SHARE * m.available < S_raw):
        return
    raw, jpeg = fig("raw", RAW_BYTES, raw_ms), fig("jpeg:90", jpeg_bytes, jpeg_ms)
    p_raw, p_jpeg = predict(m, raw), predict(m, jpeg)
    assert p_raw.fits is False and p_jpeg.fits is True and p_jpeg.disk_per_s is None
    assert p_raw.bound in ("disk", "memory")
    preds, choice, why = advise(m, [raw, jpeg])
    if p_jpeg.decode_per_s > p_raw.predicted_per_s:
        assert choice == "jpeg:90"
        assert "does not fit" in why and "jpeg:90" in why and f"{p_jpeg.predicted_per_s:,.0f}" in why
    else:
        assert choice == "raw"
    # with more candidates the choice is never raw then, and never much slower than the best
    figs = [raw, jpeg] + [f for f in others if f.codec not in ("raw", "jpeg:90")]
    preds, choice, _ = advise(m, figs)
    best = max(p.predicted_per_s for p in preds if p.predicted_per_s is not None)
    got = next(p for p in preds if p.codec == choice)
    assert got.predicted_per_s >= QUALITY_SLACK * best
    if p_jpeg.decode_per_s > p_raw.predicted_per_s:
        assert choice != "raw"


@settings(max_examples=300, deadline=None)
@given(m=machines, figs=figure_sets())
def test_the_choice_is_never_slower_than_a_lossless_alternative(m, figs):
    preds, choice, _ = advise(m, figs)
    by = {p.codec: p for p in preds}
    if by["raw"].fits or by[choice].predicted_per_s is None:
        return
    lossless = [p.predicted_per_s for p in preds if p.predicted_per_s is not None and not p.codec.startswith("jpeg")]
    if choice.startswith("jpeg"):
        assert all(by[choice].predicted_per_s >= r for r in lossless)
    assert by[choice].predicted_per_s >= QUALITY_SLACK * max(p.predicted_per_s for p in preds
                                                              if p.predicted_per_s is not None)


def test_google_landmarks_on_a_16_core_machine():
    """A Google Landmarks-sized case: 1.58M records, 64 GB for the cache, a 150 MB/s disk."""
    m = Machine(1_580_000, 64 * 10**9, 150e6, 16)
    figs = [fig("raw", RAW_BYTES, 0.02), fig("jpeg:90", 14_650, 0.8), fig("jpeg:95", 20_900, 1.1),
            fig("png:1", 86_000, 4.0), fig("zstd:3", 140_000, 0.3)]
    preds, choice, why = advise(m, figs)
    by = {p.codec: p for p in preds}
    assert choice == "jpeg:90"
    h = FIT_SHARE * 64e9 / (1_580_000 * RAW_BYTES)
    assert by["raw"].predicted_per_s == pytest.approx(150e6 / ((1 - h) * RAW_BYTES))  # about 1,300/s
    assert by["jpeg:90"].fits and by["jpeg:90"].predicted_per_s == pytest.approx(16 * 1e3 / 0.8)
    assert by["jpeg:95"].fits and by["jpeg:95"].predicted_per_s < QUALITY_SLACK * by["jpeg:90"].predicted_per_s
    assert by["png:1"].fits is False and by["png:1"].bound == "disk"
    assert "20,000 samples/s on 16 cores" in why and "--codec FIELD=jpeg:90" in why and "lossy" in why
    # a machine whose jpeg:95 decode is nearly as fast takes the better quality
    figs[2] = fig("jpeg:95", 20_900, 0.85)
    assert advise(m, figs)[1] == "jpeg:95"
    # a fast disk (NVMe at 7 GB/s) keeps raw, whatever the rotational flag says
    fast = Machine(1_580_000, 64 * 10**9, 7e9, 16)
    preds, choice, why = advise(fast, figs)
    assert choice == "raw" and "does not fit" in why and "bound by the disk" in why


def test_nothing_measured_keeps_raw():
    preds, choice, why = advise(Machine(1000, None, None, 4), [fig("raw", RAW_BYTES, 0.02),
                                                               fig("jpeg:90", 14_000, 0.8)])
    assert choice == "raw" and "not enough was measured" in why
    assert all(p.predicted_per_s is None and p.bound == "unknown" for p in preds)


@pytest.fixture(scope="module")
def photo_store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("codecs") / "p.store")
    rng = np.random.default_rng(0)
    imgs = [photo(rng, 48, 40) for _ in range(12)]
    with mmstore.StoreWriter(path, {"image": ("|u1", (48, 40, 3)), "label": ("<i8", ())}) as w:
        for i, img in enumerate(imgs):
            w.append({"image": img, "label": np.int64(i)})
    return path


def test_measure_codecs_on_the_store_records(photo_store):
    with mmstore.open(photo_store) as s:
        name, figs, notes = measure_codecs(s, sample=8, max_seconds=60)  # never cut short by a loaded machine
        imgs = s.read_batch(sample_indices(12, 8, 0), fields=["image"])["image"]  # the sample it encodes
    assert name == "image" and notes == []
    by = {f.codec: f for f in figs}
    assert list(by) == ["raw", "jpeg:90", "jpeg:95", "png:1", "zstd:3"]
    rest = 8  # the label stays raw
    assert by["raw"].record_bytes == 48 * 40 * 3 + 8 and by["raw"].ratio == 1.0 and by["raw"].encode_ms is None
    from mmstore.format.codecs import parse_codec

    for spec in ("jpeg:90", "png:1", "zstd:3"):
        c = parse_codec(spec)
        mean = np.mean([len(c.encode(im)) for im in imgs])
        assert by[spec].record_bytes == pytest.approx(rest + 8 + mean)  # + the entry's offset
        assert by[spec].sample == 8 and by[spec].decode_ms > 0 and by[spec].encode_ms > 0
    assert by["jpeg:90"].record_bytes < by["jpeg:95"].record_bytes < by["raw"].record_bytes
    assert by["png:1"].lossless and not by["jpeg:90"].lossless


def test_codecs_that_cannot_store_the_field_are_named(tmp_path):
    path = str(tmp_path / "f.store")
    with mmstore.StoreWriter(path, {"x": ("<f4", (16,))}) as w:
        for i in range(5):
            w.append({"x": np.full(16, i, np.float32)})
    with mmstore.open(path) as s:
        adv = codec_advice(s, available=10**9, seq_bytes_per_s=1e8, sample=4, max_seconds=1)
    assert adv.field == "x" and [f.codec for f in adv.figures] == ["raw", "zstd:3"]
    assert len(adv.notes) == 3 and all("not measured" in n and "Use zstd" in n for n in adv.notes)
    assert adv.choice == "raw"


def test_doctor_prints_the_codec_section(photo_store, capsys):
    rc, out, _ = run_cli(["doctor", photo_store, "--budget", "2", "--no-cold"], capsys)
    assert rc == 0
    lines = out.splitlines()
    head = next(k for k, ln in enumerate(lines) if ln.startswith("codecs "))
    assert "field 'image' (now raw), 12 records sampled" in lines[head]
    table = "\n".join(lines[head + 1 : head + 8])
    for spec in ("raw", "jpeg:90", "jpeg:95", "png:1", "zstd:3"):
        assert f"  {spec} " in table
    assert any(ln.startswith("codec advice   raw: the raw store") for ln in lines)  # 12 tiny records fit
    rc, rep = run_json(["doctor", photo_store, "--budget", "2", "--no-cold"], capsys)
    assert rc == 0 and rep["codecs"]["choice"] == "raw" and len(rep["codecs"]["predictions"]) == 5
    rc, out, _ = run_cli(["doctor", photo_store, "--budget", "1", "--no-cold", "--no-codecs"], capsys)
    assert rc == 0 and "codec advice" not in out


def test_bench_measures_the_codecs_side_by_side(photo_store, capsys):
    rc, rep = run_json(["bench", photo_store, "--codecs", "raw,jpeg:80,zstd", "--max-seconds", "1"], capsys)
    assert rc == 0 and rep["cases"] == []  # --codecs alone runs no read case
    figs = rep["codecs"]["figures"]
    assert [f["codec"] for f in figs] == ["raw", "jpeg:80", "zstd:3"]
    assert all(f["threads"] >= 1 and f["threads_per_s"] > 0 for f in figs)
    assert figs[1]["record_bytes"] < figs[2]["record_bytes"] <= figs[0]["record_bytes"] + 64
    rc, out, _ = run_cli(["bench", photo_store, "--codecs", "--max-seconds", "1"], capsys)
    assert rc == 0 and "codec advice   raw" in out and "  png:1 " in out and "samples/s  MB/s" not in out
    rc, _, err = run_cli(["bench", photo_store, "--codecs", "webp"], capsys)
    assert rc == 2 and "unknown codec 'webp'" in err


def test_doctor_on_a_compact_store(tmp_path, capsys):
    """An encoded store: doctor evicts and reads its entries, and the codec
    section re-encodes the decoded pixels (the field is jpeg:90 now)."""
    path = str(tmp_path / "j.store")
    rng = np.random.default_rng(1)
    with mmstore.StoreWriter(path, {"image": ("|u1", (48, 40, 3), "jpeg:90"), "label": ("<i8", ())}) as w:
        for i in range(10):
            w.append({"image": photo(rng, 48, 40), "label": np.int64(i)})
    rc, rep = run_json(["doctor", path, "--budget", "2", "--samples", "8"], capsys)
    assert rc == 0 and rep["cold_reads_per_s"] > 0
    adv = rep["codecs"]
    assert adv["field"] == "image" and adv["current"] == "jpeg:90" and adv["choice"] == "raw"
    by = {f["codec"]: f for f in adv["figures"]}
    assert by["raw"]["record_bytes"] == 48 * 40 * 3 + 8  # every field decoded, not the fixed part only
    assert by["jpeg:90"]["record_bytes"] < by["raw"]["record_bytes"] / 2


# -- doctor's order advice and disk kind follow what was measured ---------------------------


def _rep(records, record_bytes, warm, decode=None, seq_mb=200.0, c1=5000.0, cq=20000.0):
    from types import SimpleNamespace

    return SimpleNamespace(records=records, record_bytes=record_bytes, store_bytes=records * record_bytes,
                           seq_mb_per_s=seq_mb, cold_reads_per_s_1=c1, cold_reads_per_s=cq, warm_reads_per_s=warm,
                           decode_reads_per_s=decode, cores=2)


@settings(max_examples=60, deadline=None)
@given(decode=st.floats(10.0, 1e6), warm=st.floats(10.0, 1e6), big=st.booleans())
def test_order_advice_predicts_min_of_disk_and_decode_rate(decode, warm, big):
    """An encoded store's predicted records/s is min(disk rate, decode rate x
    cores) (doctor measures the latter); a raw store's is capped by its warm
    copies, as before."""
    from mmstore.check.order_advice import order_advice

    records = 10**9 if big else 100  # 15 TB: does not fit anywhere; 1.5 MB: fits
    raw = order_advice(_rep(records, 15_000, warm))
    enc = order_advice(_rep(records, 15_000, warm, decode=decode))
    disk = order_advice(_rep(records, 15_000, None))  # no cap: the disk's rate alone
    assert raw["fits"] == enc["fits"] == (not big)
    if big:
        expect = min(disk["expected_records_per_s"], decode)
        assert enc["expected_records_per_s"] == pytest.approx(expect)
        assert raw["expected_records_per_s"] == pytest.approx(min(disk["expected_records_per_s"], warm))
    else:
        assert enc["expected_records_per_s"] == pytest.approx(decode) and enc["bound"] == "decode"
        assert raw["expected_records_per_s"] == pytest.approx(warm) and raw["bound"] == "memory"
    assert (enc["bound"] == "decode") == (enc["expected_records_per_s"] >= decode * (1 - 1e-9))
    if enc["bound"] == "decode":
        assert "decoding the encoded fields on 2 cores" in enc["why"]


@pytest.mark.parametrize("flag, reads, kind", [(True, 8000.0, "flash"), (False, 90.0, "spinning"),
                                               (None, 500.0, "between")])
def test_doctor_names_the_disk_by_its_measured_reads_not_the_kernel_flag(photo_store, monkeypatch, capsys, flag,
                                                                         reads, kind):
    """A virtual disk the kernel calls rotational but that serves
    8,000 cold random reads/s is not an "HDD"; a disk flagged non-rotational
    that seeks like one is called a spinning disk."""
    from mmstore.check import doctor
    from mmstore.cli.doctor import render

    monkeypatch.setattr(doctor._os, "disk_info", lambda p: {"fs_type": "ext4", "device": "vda", "rotational": flag})
    monkeypatch.setattr(doctor, "_evict_records", lambda store, slots: True)
    monkeypatch.setattr(doctor, "_time_reads", lambda store, idx, threads, deadline: (len(idx), len(idx) / reads))
    rep = doctor.doctor_store(photo_store, samples=16, threads=2, budget_s=1.0, seq_bytes=1 << 20, cold=True,
                              seed=0, codecs=False)
    assert rep.cold_reads_per_s_1 == pytest.approx(reads) and rep.disk_kind == kind
    # the disk's share: a cold read is the disk's time plus a warm read's
    assert rep.disk_reads_per_s == pytest.approx(1 / (1 / reads - 1 / rep.warm_reads_per_s))
    text = render(rep)
    assert "HDD" not in text and "SSD" not in text
    assert {"flash": "behaves like flash", "spinning": "behaves like a spinning disk",
            "between": "between flash and a spinning disk"}[kind] in text
    disagree = [n for n in rep.notes if "the kernel marks vda" in n]
    assert len(disagree) == (1 if kind != "between" and flag is not None else 0)
    if disagree:
        assert f"{rep.disk_reads_per_s:,.0f} cold random reads/s" in disagree[0]
        assert "follows the measurement" in disagree[0]


def test_an_encoded_store_s_decode_time_is_not_taken_for_the_disk(monkeypatch):
    """A cold read of an encoded record is the disk's time plus its decode:
    450 cold reads/s that are 1.7 ms of decode (warm 590/s) are a fast disk,
    and the epoch model uses the decode rate on every core."""
    from mmstore.check.doctor import DoctorReport, _predict, disk_kind, disk_reads_per_s

    rep = DoctorReport("s", "memmap", 2400, 15_000, 36_000_000, disk={"rotational": True})
    rep.cold_reads_per_s_1, rep.cold_reads_per_s, rep.warm_reads_per_s = 450.0, 620.0, 590.0
    rep.cores, rep.decode_reads_per_s, rep.mem_available = 2, 1180.0, 1 << 34
    assert disk_reads_per_s(rep) == pytest.approx(1 / (1 / 450 - 1 / 590)) and disk_kind(rep) == "flash"
    _predict(rep)
    assert rep.predictions[0].epoch2_s == pytest.approx(2400 / 1180.0)
    rep.warm_reads_per_s = 400.0  # a cold read no slower than a warm one: the disk is not what limits
    assert disk_reads_per_s(rep) == float("inf") and disk_kind(rep) == "flash"


def test_order_advice_predicts_the_permutation_from_the_reads_the_loader_will_do(tmp_path, monkeypatch):
    """A store that does not fit is read by the Loader with O_DIRECT
    (no page cache), so doctor predicts its permutation from an O_DIRECT probe
    and says so; a store that fits, or a file system that refuses O_DIRECT,
    gets the page-cache probe, also named."""
    from mmstore.check import order_advice as oa

    p = tmp_path / "data.bin"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 300 * 15_000, dtype=np.uint8).tobytes())
    measured = oa.probe_random_direct(str(p), 15_000, 4, 0.3)
    fd = None
    try:
        fd = os.open(str(p), os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        pass
    if fd is not None and getattr(os, "O_DIRECT", 0):
        os.close(fd)
        assert measured is not None and measured > 0
    else:
        assert measured is None
    monkeypatch.setattr(oa, "probe_random_direct", lambda path, r, t, s: None if path is None else 1000.0)
    monkeypatch.setattr(oa, "probe_random", lambda path, r, t, s: None if path is None else 400.0)
    big = oa.order_advice(_rep(10**9, 15_000, None), probe=str(p))
    assert not big["fits"] and "O_DIRECT" in big["permutation_probe"]
    assert big["rates_MBps"]["permutation"] == pytest.approx(1000.0 * 15_000 / 1e6)
    assert "O_DIRECT random reads" in "\n".join(oa.order_lines(big))
    small = oa.order_advice(_rep(100, 15_000, None), probe=str(p))
    assert small["fits"] and "page cache" in small["permutation_probe"]
    assert small["rates_MBps"]["permutation"] == pytest.approx(400.0 * 15_000 / 1e6)
    monkeypatch.setattr(oa, "probe_random_direct", lambda path, r, t, s: None)  # O_DIRECT refused
    refused = oa.order_advice(_rep(10**9, 15_000, None), probe=str(p))
    assert "page cache" in refused["permutation_probe"]
    assert refused["rates_MBps"]["permutation"] == pytest.approx(400.0 * 15_000 / 1e6)
    none = oa.order_advice(_rep(10**9, 15_000, None))  # no probe file: doctor's own cold reads
    assert none["permutation_probe"] == "doctor's cold record reads"
    assert none["rates_MBps"]["permutation"] == pytest.approx(20000.0 * 15_000 / 1e6)
