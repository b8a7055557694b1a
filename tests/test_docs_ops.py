"""docs/ops.md names every op's arguments as the code does: each ``name(arg, ...)`` in the first
column of its tables lists the op's leading parameters, in order (a keyword call copied from the
docs works); an ellipsis stands for the rest."""

import inspect
import pathlib
import re

import moefuse

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "ops.md"


def _documented():
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*`(\w+)\(([^)]*)\)`", line)
        if m:
            args = [a.strip() for a in m.group(2).split(",") if a.strip()]
            yield m.group(1), args


def test_documented_signatures_are_the_codes():
    seen, wrong = 0, []
    for name, args in _documented():
        fn = getattr(moefuse, name, None)
        if fn is None:
            wrong.append(f"{name}: not a moefuse function")
            continue
        seen += 1
        params = list(inspect.signature(fn).parameters)
        named = [a for a in args if a != "..."]
        if params[: len(named)] != named:
            wrong.append(f"{name}({', '.join(args)}) vs code {params[: len(named)]}")
    assert seen >= 20 and not wrong, wrong


def test_impl_is_keyword_only_except_where_the_docs_say():
    text = DOC.read_text()
    head = text[: text.index("##")]
    for name, _ in _documented():
        param = inspect.signature(getattr(moefuse, name)).parameters.get("impl")
        if param is None or param.kind is not inspect.Parameter.KEYWORD_ONLY:
            assert f"`{name}`" in head, f"{name} takes no keyword-only impl: the docs must say so"
