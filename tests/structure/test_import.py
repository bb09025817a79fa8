"""``import mmstore`` needs numpy only; the core works without torch, lmdb and cv2."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_import_and_memmap_store_without_torch_lmdb_cv2(tmp_path):
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        BLOCKED = ("torch", "lmdb", "cv2")
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked {{name}}")
        sys.meta_path.insert(0, Block())
        import mmstore, numpy as np
        assert not any(m.split(".")[0] in BLOCKED for m in sys.modules), sorted(sys.modules)
        p = {str(tmp_path / "s")!r}
        with mmstore.StoreWriter(p, {{"x": ("<f4", (3,))}}, slots=2) as w:
            w.write(0, {{"x": [1, 2, 3]}}); w.write(1, {{"x": [4, 5, 6]}})
        s = mmstore.open(p)
        assert s[1]["x"].tolist() == [4, 5, 6]
        try:
            mmstore.StoreWriter(p + "-l", {{"x": ("<f4", ())}}, slots=1, backend="lmdb").close()
        except ImportError as e:
            assert "pip install lmdb" in str(e), e
        else:
            raise SystemExit("lmdb backend worked without lmdb")
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_cli_and_tools_import_without_torch_lmdb_cv2():
    """Every command module imports torch, cv2 and lmdb only inside the
    functions that need them, so `mmstore --help` works with numpy alone."""
    code = textwrap.dedent("""
        import importlib.abc, sys
        BLOCKED = ("torch", "lmdb", "cv2")
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked {name}")
        sys.meta_path.insert(0, Block())
        from mmstore.cli import COMMANDS, build_parser
        build_parser()
        import mmstore.check, mmstore.order, mmstore._os, mmstore.decode, mmstore.ingest
        for name in ("bench", "verify", "inspect", "show", "doctor", "convert", "repair", "cache"):
            __import__(f"mmstore.check.{name}")
        assert not any(m.split(".")[0] in BLOCKED for m in sys.modules)
        print(len(COMMANDS))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) >= 10
