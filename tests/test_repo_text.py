"""The repository's text stands on its own and says what things are.

* Nothing points outside the repository for its contract: no path into a sibling ``shared``
  folder, no outside spec file, no section-number citations (the sign is not used at all; code
  and docs name the operation or cite a heading of docs/spec.md).
* Nothing tells how or in which working session it was made: no "session" word and no issue
  number used as history. The only use of the word allowed is the POSIX one in
  ``subprocess.Popen(start_new_session=...)``.

Every tracked text file is read (binary files, i.e. files holding a NUL byte or not UTF-8, are
skipped), except this file, which spells the patterns it looks for.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SECTION_SIGN = "\u00a7"
OUTSIDE = [
    re.compile(re.escape(".." + "/shared")),
    re.compile(re.escape("SPEC" + ".md")),
    re.compile(r"\b" + "SP" + r"EC\b"),  # the outside spec by name (docs/spec.md is "the spec")
    re.compile(re.escape(SECTION_SIGN)),
    re.compile(r"\\u00a7", re.I),  # the same sign escaped in JSON
]
HISTORY = [
    re.compile(r"\b" + "sess" + r"ions?\b", re.I),
    re.compile(r"\b" + "iss" + r"ue #?\d+|\b" + "iss" + r"ues #\d+", re.I),  # not "issues 28.6 ..."
    re.compile(r"\b(?:fifth|sixth|seventh)\s+" + "sess", re.I),
]
#: (pattern, allowed text around a hit): the narrow exceptions, each with its reason
ALLOWED = [
    # POSIX process sessions: the keyword argument of subprocess.Popen
    "start_new_" + "session",
    # pytest's fixture scope
    'scope="' + 'session"',
]


def _tracked_names() -> list[str]:
    """Paths of the tracked files (skips the test outside a git checkout)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the list of tracked files)")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [name for name in out.stdout.decode().split("\0") if name]


def _tracked_text_files():
    for name in _tracked_names():
        path = ROOT / name
        if not path.is_file() or path == Path(__file__).resolve():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            yield name, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def _hits(patterns):
    found = []
    for name, text in _tracked_text_files():
        for lineno, line in enumerate(text.splitlines(), 1):
            for allowed in ALLOWED:
                line = line.replace(allowed, "")
            if any(p.search(line) for p in patterns):
                found.append(f"{name}:{lineno}: {line.strip()[:120]}")
    return found


def test_tracked_files_are_found():
    names = [n for n, _ in _tracked_text_files()]
    assert "docs/spec.md" in names and "README.md" in names and len(names) > 100


def test_no_reference_outside_the_repository():
    hits = _hits(OUTSIDE)
    assert not hits, "cite docs/spec.md by heading instead:\n" + "\n".join(hits)


def test_no_session_or_issue_history():
    hits = _hits(HISTORY)
    assert not hits, "say what the thing is, not how it was made:\n" + "\n".join(hits)


def test_no_session_in_file_names():
    """File names too (a log is named by its date and the commit it ran)."""
    history = re.compile("sess" + "ion|iss" + r"ue[-_ ]?\d", re.I)
    names = [n for n in _tracked_names() if history.search(n)]
    assert not names, names


def test_the_patterns_match_what_they_forbid():
    assert any(p.search("see " + "SP" + "EC " + SECTION_SIGN + "4.2") for p in OUTSIDE)
    assert any(p.search("x " + "../shared" + "/y.md") for p in OUTSIDE)
    assert any(p.search('"\\' + 'u00a73.3 at M"') for p in OUTSIDE)
    assert not any(p.search("docs/spec.md, the spec's NVFP4 format") for p in OUTSIDE)
    assert any(p.search("measured in " + "Sess" + "ion 12") for p in HISTORY)
    assert any(p.search("(" + "iss" + "ue 17e)") for p in HISTORY)
    assert not any(p.search("the kernel " + "iss" + "ues 28.6 instructions") for p in HISTORY)
    line = "Popen(cmd, " + ALLOWED[0] + "=True)"
    for allowed in ALLOWED:
        line = line.replace(allowed, "")
    assert not any(p.search(line) for p in HISTORY)
