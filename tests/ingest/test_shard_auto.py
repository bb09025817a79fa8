"""--shard auto: the part comes from the launcher (torchrun, SLURM arrays); parts merge into the one store."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mmstore
from mmstore.ingest import ingest
from mmstore.ingest.options import parse_shard, shard_from_env


@pytest.mark.parametrize(
    "env,want",
    [
        ({"RANK": "1", "WORLD_SIZE": "4"}, (1, 4)),
        # torchrun of one process per array task: the array numbers the parts (each array task got
        # part 0 of 1, the whole input, before)
        ({"RANK": "0", "WORLD_SIZE": "1", "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"}, (3, 4)),
        ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "1"}, (1, 2)),
        ({"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "1",
          "SLURM_ARRAY_TASK_MAX": "8"}, (7, 8)),
        ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0",
          "SLURM_ARRAY_TASK_MAX": "6", "SLURM_ARRAY_TASK_STEP": "2"}, (2, 4)),
        ({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4"}, (2, 4)),
        ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "5"}, (2, 4)),
        ({"SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1",
          "SLURM_ARRAY_TASK_STEP": "4"}, (2, 3)),
    ],
)
def test_shard_from_env(env, want):
    assert shard_from_env(env) == want


@pytest.mark.parametrize(
    "env,match",
    [
        ({}, "neither RANK/WORLD_SIZE"),
        ({"RANK": "1"}, "WORLD_SIZE is not set"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"part 4 of 4"),
        ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4"}, "SLURM_ARRAY_TASK_MIN"),
        ({"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "4"}, "not an integer"),
        ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_STEP": "3"}, "STEP"),
        # torchrun of several processes inside an array of several tasks: RANK/WORLD_SIZE alone made
        # every array task ingest the same parts
        ({"RANK": "1", "WORLD_SIZE": "4", "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "8"},
         r"both RANK/WORLD_SIZE .* K = array_index \* WORLD_SIZE \+ RANK"),
        # an index list (--array=1,3,5): task 3 took part 2 of 3 and part 1 was never made
        ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1",
          "SLURM_ARRAY_TASK_MAX": "5"}, r"has gaps \(3 tasks, not 5"),
        ({"WORLD_SIZE": "4"}, r"RANK is not set .*pass --shard K/N"),
    ],
)
def test_shard_from_env_errors(env, match):
    with pytest.raises(ValueError, match=match):
        shard_from_env(env)


def test_parse_shard_auto_reads_the_environment(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="pass --shard K/N"):
        parse_shard("auto")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    assert parse_shard("auto") == (1, 3)


def _records(path):
    st = mmstore.open(path)
    cols = {f: st.column(f) for f in st.fields}
    return cols, [st.key(i) for i in range(len(st))], st.label_names


def test_torchrun_shards_then_merge_equal_one_ingest(tmp_path, h):
    src = str(tmp_path / "src")
    h.make_folder(src, ("a", "b", "c"), per_class=5, sizes=(20, 40))
    parts = tmp_path / "parts"
    parts.mkdir()
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {h.REPO!r})
        from mmstore.cli import main
        sys.exit(main(["ingest", {src!r}, os.path.join({str(parts)!r}, "part" + os.environ["RANK"]),
                       "--size", "16x16", "--workers", "0", "--shard", "auto", "--quiet"]))
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                        str(script)], env=env, capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    for k in (0, 1):
        prov = mmstore.open(str(parts / f"part{k}")).provenance["ingest"]
        assert prov["shard"] == [k, 2]
    merged = str(tmp_path / "merged")
    assert h.cli("merge", str(parts / "part0"), str(parts / "part1"), merged) == 0
    one = str(tmp_path / "one")
    ingest(src, one, (16, 16), workers=0, quiet=True)
    (ca, ka, na), (cb, kb, nb) = _records(merged), _records(one)
    assert ka == kb and na == nb and len(ka) == 15
    assert sorted(ca) == sorted(cb)
    for f in ca:
        assert np.array_equal(ca[f], cb[f]), f
