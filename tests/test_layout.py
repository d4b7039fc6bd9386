"""The package's shape: no import cycles between its modules (imports inside functions count too),
the engine imports no format family, no family imports another, and every module says its job in a
docstring. The cycle finder is shown failing on a planted circle."""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "qattn"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root (a package directory)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (module level or in a function).
    ``from P import x`` is an edge to P.x when that is a module, else to P."""
    is_package = path.name == "__init__.py"
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        edges.update(t for t in targets if t in known and t != name)
    return edges


def import_graph(root: Path) -> dict[str, set[str]]:
    known = module_names(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), as a sorted list."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph(PACKAGE)
    assert len(graph) > 40 and "qattn.engine.kernel" in graph
    assert cycles(graph) == []


def test_the_cycle_finder_fails_on_a_planted_circle(tmp_path):
    pkg = tmp_path / "planted"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": '"""A package with a circle."""\n',
        "a.py": "from .sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..c import g\n    return g\n",  # a function-level import counts
        "c.py": "import planted.a\n\ndef g():\n    pass\n",
        "d.py": "from . import a\n",  # imports into the circle, is not part of it
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    assert cycles(import_graph(pkg)) == [["planted.a", "planted.c", "planted.sub.b"]]
    (pkg / "c.py").write_text("def g():\n    pass\n")  # break the circle
    assert cycles(import_graph(pkg)) == []


def _layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[1:2] == ["formats"] and len(parts) > 2 else ".".join(parts[:2])


def test_engine_imports_no_family_and_no_family_another():
    graph = import_graph(PACKAGE)
    families = {m for m in graph if m.count(".") == 2 and m.startswith("qattn.formats.")}
    assert {"qattn.formats.dense", "qattn.formats.int8qk", "qattn.formats.kv8"} <= families
    for module, targets in graph.items():
        if module.startswith("qattn.engine"):
            outside = {t for t in targets if not t.startswith("qattn.engine") and t != "qattn.version"}
            assert not outside, f"{module} (engine) imports {sorted(outside)}"
        family = _layer(module)
        if family in families:
            others = {t for t in targets if _layer(t) in families and _layer(t) != family}
            assert not others, f"{module} imports another family: {sorted(others)}"


@pytest.mark.parametrize("module", sorted(module_names(PACKAGE)))
def test_every_module_says_its_job(module):
    tree = ast.parse(module_names(PACKAGE)[module].read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split()) >= 4, f"{module}: no docstring saying its one job"


def test_ls_qattn_shows_the_architecture():
    top = {p.name for p in PACKAGE.iterdir() if not p.name.startswith(("_", "."))}
    assert {"engine", "formats", "check", "bench", "templates"} <= top
    assert not (PACKAGE / "runtime").exists() and not (PACKAGE / "codegen").exists()
    families = sorted(p.name for p in (PACKAGE / "formats").iterdir() if (p / "__init__.py").is_file())
    init = textwrap.dedent((PACKAGE / "formats" / "__init__.py").read_text())
    for family in families:  # one registry line per family folder
        assert family in init.split("import", 1)[1], f"formats/{family} is not registered in formats/__init__.py"


def test_template_names_are_unique_across_folders():
    """A template is found by name in the shared folder, then in each family's: a name in two
    folders would be shadowed without a word."""
    from qattn.engine import registry

    seen = {}
    for folder in registry.template_dirs():
        for path in folder.rglob("*.j2"):
            name = str(path.relative_to(folder))
            assert name not in seen, f"template {name} is in both {seen[name]} and {folder}"
            seen[name] = folder
    assert "cuda/common.cuh.j2" in seen and "cuda/prefill_mma.cu.j2" in seen
