"""notes/gpu-logs/ holds the logs behind figures the repository quotes today, and nothing else.

* Every log a tracked file quotes (``notes/gpu-logs/<name>``, brace and ``*`` patterns
  expanded) exists; a quote of a log kept only in git names its revision
  (``git show <rev>:notes/gpu-logs/<name>``) and is not checked.
* Every log in notes/gpu-logs/ is quoted somewhere outside it, by path or by name (a log that
  nothing quotes is history: git keeps it).

Every tracked text file is read except the logs and this file, which spells the patterns.
"""

import fnmatch
import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "notes" / "gpu-logs"
#: a quote: the path, possibly wrapped onto the next comment line, then a name or a pattern
QUOTE = re.compile(r"(?<![0-9a-f]:)notes/gpu-logs/\s*(?:#:\s*)?([A-Za-z0-9_.{},*\-]+)")


def _texts() -> dict[str, str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the list of tracked files)")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    texts = {}
    for name in out.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or name.startswith("notes/gpu-logs/") or not path.is_file():
            continue
        if path == Path(__file__).resolve():  # this file spells the patterns
            continue
        try:
            texts[name] = path.read_text()
        except UnicodeDecodeError:
            continue
    return texts


def _expand(pattern: str) -> list[str]:
    """Shell brace expansion, with ``{a..b}`` integer ranges."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    inner = m.group(1)
    if ".." in inner:
        lo, hi = inner.split("..")
        options = [str(i) for i in range(int(lo), int(hi) + 1)]
    else:
        options = inner.split(",")
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return list(itertools.chain.from_iterable(_expand(head + o + tail) for o in options))


def _quotes(texts: dict[str, str]) -> list[tuple[str, str]]:
    """(file, pattern) for every quoted log path."""
    found = []
    for name, text in texts.items():
        flat = re.sub(r"\n\s*(?:#:|#)?\s*", " ", text)  # wrapped lines joined
        for m in QUOTE.finditer(flat):
            pattern = m.group(1).rstrip(".,;")
            if pattern:
                found.extend((name, p) for p in _expand(pattern))
    return found


def test_every_quoted_log_exists():
    logs = sorted(p.name for p in LOGS.iterdir())
    missing = [
        f"{name}: notes/gpu-logs/{pattern}"
        for name, pattern in _quotes(_texts())
        if not any(fnmatch.fnmatch(log, pattern) or log.startswith(pattern) for log in logs)
    ]
    assert not missing, "quoted logs that are not in notes/gpu-logs/:\n" + "\n".join(missing)


def test_every_log_is_quoted():
    texts = _texts()
    quoted = {pattern for _, pattern in _quotes(texts)}
    everything = "\n".join(texts.values())
    unquoted = []
    for log in sorted(p.name for p in LOGS.iterdir()):
        stem = log.rsplit(".", 1)[0]
        if stem in everything or any(fnmatch.fnmatch(log, p) for p in quoted):
            continue
        unquoted.append(log)
    assert not unquoted, "logs nothing quotes (delete them, git keeps them):\n" + "\n".join(
        unquoted
    )


def test_the_patterns_expand_as_the_shell_does():
    assert _expand("2026-11-30-run{2,3}-{new,old}.log") == [
        "2026-11-30-run2-new.log",
        "2026-11-30-run2-old.log",
        "2026-11-30-run3-new.log",
        "2026-11-30-run3-old.log",
    ]
    assert _expand("run1{2..4}-*") == ["run12-*", "run13-*", "run14-*"]
    quotes = _quotes(
        {"a.md": "see notes/gpu-logs/\n#: x-1.log and `git show abc1234:notes/gpu-logs/y.log`"}
    )
    assert quotes == [("a.md", "x-1.log")]
