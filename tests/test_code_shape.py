"""Kernels stay readable: no ``@triton.jit`` function of src/ takes more than 32 parameters
(argument lists are grouped into tuples, notes/kernel-arguments.md) and no function of src/ is
over 100 lines (``def`` line to last line, decorators excluded, as committed); no module of src/
is over 900 lines as formatted (``ruff format``, checked by ``make test``)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_JIT_PARAMS = 32
MAX_LINES = 100
MAX_MODULE_LINES = 900


def _is_jit(node: ast.FunctionDef) -> bool:
    """``@triton.jit``, ``@triton.jit(...)``, ``@jit`` and the like."""
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "jit":
            return True
    return False


def _params(node: ast.FunctionDef) -> int:
    a = node.args
    return (
        len(a.posonlyargs)
        + len(a.args)
        + len(a.kwonlyargs)
        + (a.vararg is not None)
        + (a.kwarg is not None)
    )


def over_limits(root: Path = SRC) -> dict[tuple[str, str], str]:
    """``{(module, function): "N parameters" / "N lines"}`` for every function of ``root``'s
    modules over a limit (nested functions and methods included)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            why = []
            if _is_jit(node) and _params(node) > MAX_JIT_PARAMS:
                why.append(f"{_params(node)} parameters")
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES:
                why.append(f"{lines} lines")
            if why:
                out[(module, node.name)] = ", ".join(why)
    return out


def test_no_function_over_the_limits():
    found = over_limits()
    assert not found, (
        f"over {MAX_JIT_PARAMS} parameters (@triton.jit) or {MAX_LINES} lines: {found}; group the "
        "arguments into tuples (notes/kernel-arguments.md) or split the function"
    )


def test_the_walk_finds_what_it_must(tmp_path):
    """The walk counts a jit kernel's parameters and a plain function's lines (the check above
    cannot pass by finding nothing)."""
    params = ", ".join(f"a{i}" for i in range(MAX_JIT_PARAMS + 1))
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(
        "import triton\n\n\n"
        f"@triton.jit(do_not_specialize=['a0'])\ndef wide({params}):\n    pass\n\n\n"
        f"@triton.jit\ndef narrow({params[: params.rindex(',')]}):\n    pass\n\n\n"
        f"def long():\n{body}\n\n\n"
        f"def short():\n{body[: body.rindex(chr(10))]}\n"
    )
    assert over_limits(tmp_path) == {
        ("m.py", "wide"): f"{MAX_JIT_PARAMS + 1} parameters",
        ("m.py", "long"): f"{MAX_LINES + 1} lines",
    }


def long_modules(root: Path = SRC) -> dict[str, int]:
    """``{module: lines}`` for every module of ``root`` over :data:`MAX_MODULE_LINES`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            out[path.relative_to(root).as_posix()] = lines
    return out


def test_no_module_over_the_limit(tmp_path):
    found = long_modules()
    assert not found, f"modules over {MAX_MODULE_LINES} lines: {found}; split by job"
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert long_modules(tmp_path) == {"long.py": MAX_MODULE_LINES + 1}
