"""Packaging metadata, the Makefile's wheel check, and the documentation's links and coverage."""

import inspect
import re
from pathlib import Path

import pytest

import moefuse

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_license_and_extras():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = data["project"]
    assert isinstance(project["license"], str)  # SPDX expression, not the deprecated table
    for name in project["license-files"]:
        assert (ROOT / name).is_file(), name
    extras = project["optional-dependencies"]
    assert "transformers>=5" in extras["transformers"] and "tqdm" in extras["bench"]
    assert any(r.startswith("setuptools>=77") for r in data["build-system"]["requires"])
    urls = project["urls"]
    assert {"Homepage", "Documentation", "Issues"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())


def test_make_test_checks_the_wheel_once():
    make = (ROOT / "Makefile").read_text()
    test_deps = re.search(r"^test: (.*)$", make, re.M).group(1).split()
    assert "$(WHEEL_STAMP)" in test_deps
    assert "scripts/check_wheel.sh" in re.search(r"^\$\(WHEEL_STAMP\): (.*)$", make, re.M).group(1)
    assert "[test,bench,transformers]" in make


def _links(path: Path):
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", path.read_text()):
        if not re.match(r"[a-z]+:", target):
            yield target


def test_docs_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) >= 8
    for page in pages:
        for target in _links(page):
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


def test_every_public_op_has_a_formula_line():
    ops = (ROOT / "docs" / "ops.md").read_text()
    helpers = {"scale_shape"}
    names = [
        n
        for n in moefuse.__all__
        if not n.startswith("supports_")
        and n not in helpers
        and inspect.isfunction(getattr(moefuse, n))
    ]
    assert len(names) >= 25
    missing = [n for n in names if f"`{n}(" not in ops and f"`{n}`" not in ops]
    assert not missing, f"docs/ops.md has no line for {missing}"


def test_every_public_op_is_in_the_spec():
    """docs/spec.md names every public op of moefuse and moefuse.comm (a heading or a formula)."""
    import moefuse.comm

    spec = (ROOT / "docs" / "spec.md").read_text()
    names = dict.fromkeys(
        n for n in [*moefuse.__all__, *moefuse.comm.__all__] if not n.startswith("supports_")
    )
    assert len(names) >= 40
    missing = [n for n in names if not re.search(rf"`{n}[`(]|^###.*\b{n}\b", spec, re.M)]
    assert not missing, f"docs/spec.md does not say what {missing} compute"
