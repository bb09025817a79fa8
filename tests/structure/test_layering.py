"""The package's structure, read from its imports: which layer may import
which, no import circle, no private name reached from another package.

The layers, lowest first (a package may import only the packages before it;
imports inside functions count, imports under ``if TYPE_CHECKING:`` do not;
for circles they count too):

``errors``, ``_version``
    the error hierarchy and the version: no mmstore import.
``_os``
    every system call: reads, page cache, memory, disk, locks, safe copies.
``format``
    the on-disk specification (its docstring), manifest, schema, codecs.
``remote``
    stores in object storage: URLs, the client, the remote index, the sparse replica.
``store``
    reading (``Store``) and writing (``StoreWriter``) stores; the backends.
``order``
    sample orders, their measurements, splits.
``decode``
    decoding images for ingest.
``engine``
    the torch-free batch engine: read plan, read strategies, resume state.
``ingest``
    sources, the pipeline, workers, resume, merge, the join of parts.
``torch``
    the one adapter that imports torch.
``check``
    inspect, verify, repair, show, doctor, bench, convert.
``transfer``
    push and pull of whole stores to and from object storage.
``ray``
    the Ray Data writer (the one adapter that imports Ray).
``cli``
    one module per command.

``mmstore/__init__.py`` (the public API) may import any layer. The 0.2
module names (``mmstore.geometry`` ...), aliases through 0.3, are gone.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "mmstore")
LAYERS = ["errors", "_version", "_os", "format", "remote", "store", "order", "decode", "engine", "ingest", "torch",
          "check", "transfer", "ray", "cli"]
PUBLIC_PRIVATE = {"_os", "_version"}  # underscored packages that are the project's own, used across packages
# the 0.2 names of moved modules (aliases in 0.3, removed in 0.4) and each one's home
MOVED = {"geometry": "decode.geometry", "schema": "format.schema", "codecs": "format.codecs",
         "ragged": "format.ragged", "reader": "store.reader", "writer": "store.writer", "splits": "order.splits"}


def _modules() -> dict[str, str]:
    out = {}
    for dp, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(dp, f)
                rel = os.path.relpath(p, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = p
    return out


MODULES = _modules()


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as fh:
        return ast.parse(fh.read(), path)


def _imports(mod: str, path: str, typing: bool = False) -> list[tuple[str, str, int]]:
    """(target module, imported name or "", line) of every mmstore import of ``mod``
    (with ``typing``, those under ``if TYPE_CHECKING:`` too)."""
    tree = _parse(path)
    skip = set()
    for node in ast.walk(tree):
        if not typing and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    is_pkg = path.endswith("__init__.py")
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            if not base or not (base == "mmstore" or base.startswith("mmstore.")):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, "", node.lineno) if sub in MODULES else (base, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("mmstore")]
    return out


IMPORTS = {m: _imports(m, p) for m, p in MODULES.items()}


def _package(mod: str) -> str | None:
    parts = mod.split(".")
    if len(parts) == 1:
        return None  # mmstore/__init__.py: the top
    return parts[1]


def test_every_package_is_in_a_layer():
    packages = {_package(m) for m in MODULES} - {None, "__main__"}
    assert packages <= set(LAYERS), f"packages in no layer: {sorted(packages - set(LAYERS))}"


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for mod, imports in IMPORTS.items():
        src = _package(mod)
        if src is None or src == "__main__":
            continue
        for target, _, line in imports:
            dst = _package(target)
            if dst is None or dst == src:
                continue
            if LAYERS.index(dst) > LAYERS.index(src):
                wrong.append(f"{MODULES[mod]}:{line}: {src} imports {target} (a higher layer: {dst})")
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    """Type-only imports count: a circle through them is still two concepts tangled."""
    graph = defaultdict(set)
    for mod, path in MODULES.items():
        for target, _, _ in _imports(mod, path, typing=True):
            if target in MODULES and target != mod:
                graph[mod].add(target)
    # a package's __init__ that re-exports its modules is not a circle with them when
    # they do not import it back; every other cycle is
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(MODULES):
        if v not in index:
            visit(v)
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_private_name_is_imported_from_another_package():
    wrong = []
    for mod, imports in IMPORTS.items():
        for target, name, line in imports:
            if _package(target) == _package(mod) or _package(mod) is None:
                continue
            parts = target.split(".")[1:] + ([name] if name else [])
            private = [p for p in parts if p.startswith("_") and p not in PUBLIC_PRIVATE and p != "__version__"]
            if private:
                wrong.append(f"{MODULES[mod]}:{line}: {target}{'.' + name if name else ''}")
    assert not wrong, "private names used across packages (drop the underscore):\n" + "\n".join(wrong)


@pytest.mark.parametrize("layer", ["errors", "_os", "format", "remote", "store", "order", "decode", "engine", "ingest",
                                   "transfer"])
def test_the_core_never_imports_torch(layer):
    """Only mmstore.torch imports torch at module level; check and cli import it inside the
    functions that need it (``tests/core/test_import.py`` checks the same at run time)."""
    wrong = []
    for mod, path in MODULES.items():
        if _package(mod) != layer:
            continue
        for node in ast.walk(_parse(path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "torch" or n.startswith("torch.") for n in names):
                wrong.append(f"{path}:{node.lineno}")
    assert not wrong, wrong


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_0_2_name_of_a_moved_module_is_gone_and_its_home_holds_its_names(old):
    import importlib
    import sys

    assert f"mmstore.{old}" not in MODULES
    sys.modules.pop(f"mmstore.{old}", None)
    with pytest.raises(ModuleNotFoundError, match=f"mmstore.{old}"):
        importlib.import_module(f"mmstore.{old}")
    home = importlib.import_module(f"mmstore.{MOVED[old]}")
    assert home.__all__ and all(hasattr(home, name) for name in home.__all__)


@pytest.mark.parametrize("layer", ["remote", "transfer"])
def test_the_object_store_client_is_imported_only_where_a_url_is_used(layer):
    """obstore is an optional extra: no module imports it at its top, so ``import mmstore`` and every local
    store work without it (its functions import it on first use)."""
    wrong = []
    for mod, path in MODULES.items():
        if _package(mod) != layer:
            continue
        for node in _parse(path).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "obstore" or n.startswith("obstore.") for n in names):
                wrong.append(f"{path}:{node.lineno}")
    assert not wrong, wrong
