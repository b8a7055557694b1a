"""The layout of ``moefuse.comm`` holds: the shared core imports no family, no family imports
another family, and no module of ``src/moefuse`` takes part in an import circle (imports inside
functions included: a lazy import still ties two modules together). Read with ``ast``; nothing
is imported."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
FAMILIES = ("all_reduce", "all_gather", "moe_reduction", "expert_norm")


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in (SRC / "moefuse").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods) -> set[str]:
    """Modules of ``mods`` that ``name`` imports anywhere (``from pkg import sub`` names the
    submodule when there is one, else the package)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub in mods:
                    found.add(sub)
                elif module in mods:
                    found.add(module)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _family(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["moefuse", "comm"] and parts[2] in FAMILIES:
        return parts[2]
    return None


def test_every_family_folder_exists_with_its_faces():
    for family in FAMILIES:
        folder = SRC / "moefuse" / "comm" / family
        for face in ("__init__.py", "api.py", "ops.py", "reference.py"):
            assert (folder / face).is_file(), f"{family}/{face} is missing"


def test_the_core_imports_no_family_and_no_family_another():
    bad = []
    for module, deps in _graph().items():
        if not module.startswith("moefuse.comm.") or module == "moefuse.comm":
            continue  # the package's __init__ exports the public names of every family
        mine = _family(module)
        for dep in deps:
            theirs = _family(dep)
            if dep == "moefuse.comm":
                bad.append(f"{module} imports the moefuse.comm package (every family)")
            elif theirs is not None and theirs != mine:
                who = f"family {mine}" if mine else "the core"
                bad.append(f"{module} ({who}) imports {dep} (family {theirs})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circle_in_src():
    graph = _graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
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
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_checks_see_a_circle_and_a_family_import(tmp_path, monkeypatch):
    """The checks can fail: a planted circle and a planted cross-family import are found."""
    pkg = tmp_path / "moefuse"
    for rel, text in {
        "__init__.py": "",
        "comm/__init__.py": "",
        "comm/device.py": "",
        "comm/all_reduce/__init__.py": "",
        "comm/all_reduce/api.py": "from moefuse.comm.all_gather import ops\n",
        "comm/all_gather/__init__.py": "",
        "comm/all_gather/ops.py": "def f():\n    from moefuse.comm.all_reduce import api\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    import pytest

    with pytest.raises(AssertionError, match="family all_gather"):
        test_the_core_imports_no_family_and_no_family_another()
    with pytest.raises(AssertionError, match="import circles"):
        test_no_import_circle_in_src()
