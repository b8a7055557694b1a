"""moefuse.knobs: every MOEFUSE_* variable declared once, parsed one way, read at call time (never
at import), undeclared names warned about once, the knobs ranks must share compared when a
workspace is created, and docs/knobs.md generated from the declarations."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from moefuse import knobs

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "moefuse"
#: a value each kind rejects
BAD = {"bool": "yes", "int": "two", "choice": "nope"}


@pytest.fixture
def clean_env(monkeypatch):
    """No MOEFUSE_* variable set, and the once-per-name warning state reset."""
    import os

    for name in list(os.environ):
        if name.startswith(knobs.PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.setattr(knobs, "_warned", set())
    monkeypatch.setattr(knobs, "_scanned", [False])
    return monkeypatch


# ----------------------------------------------------------------------------- parsing
def test_unset_and_empty_give_the_default(clean_env):
    for name, k in knobs.KNOBS.items():
        assert knobs.get(name) == k.default, name
        clean_env.setenv(name, "")
        assert knobs.get(name) == k.default and not knobs.is_set(name), name


def test_values_parse_one_way(clean_env):
    cases = {
        "MOEFUSE_FASTPATH": ("0", False),
        "MOEFUSE_TP_SPLIT_FOLD": ("1", True),
        "MOEFUSE_COMM_ROWS_PER_CTA": ("4", 4),
        "MOEFUSE_MOE_COMM_CTAS_PER_SM": ("2", 2),
        "MOEFUSE_MOE_COMM_SPLIT_CTAS": ("8", 8),
        "MOEFUSE_ALLGATHER_DECODE": (" slots", "slots"),
        "MOEFUSE_COMMIT": ("abc123", "abc123"),
    }
    for name, (raw, want) in cases.items():
        clean_env.setenv(name, raw)
        assert knobs.get(name) == want and knobs.is_set(name), name
    assert knobs.settings() == {n: raw for n, (raw, _) in cases.items()}
    assert "MOEFUSE_COMMIT" not in knobs.shared_settings()
    assert knobs.shared_settings()["MOEFUSE_TP_SPLIT_FOLD"] == "1"


@pytest.mark.parametrize("name", [n for n, k in knobs.KNOBS.items() if k.kind != "str"])
def test_a_bad_value_names_the_knob(clean_env, name):
    k = knobs.KNOBS[name]
    clean_env.setenv(name, BAD[k.kind])
    with pytest.raises(ValueError, match=f"^{name} must be {re.escape(k.accepts())}, got"):
        knobs.get(name)
    with pytest.raises(ValueError, match=name):
        knobs.check_all()


def test_integer_bounds(clean_env):
    for name, raw in (
        ("MOEFUSE_ALLGATHER_LOOKAHEAD", "0"),
        ("MOEFUSE_COMM_ONESHOT_WARPS", "3"),
        ("MOEFUSE_MOE_COMM_CTAS_PER_SM", "3"),
        ("MOEFUSE_MOE_COMM_SPLIT_CTAS", "6"),
        ("MOEFUSE_ALLGATHER_FUSED_GRID", "-1"),
    ):
        clean_env.setenv(name, raw)
        with pytest.raises(ValueError, match=f"{name} must be"):
            knobs.get(name)


def test_knob_choices_match_the_code():
    from moefuse.comm import transport as tp
    from moefuse.comm.moe_reduction import kernels as mk

    assert knobs.KNOBS["MOEFUSE_COMM_TRANSPORT"].choices == (
        "auto",
        *tp.CUDA_TRANSPORTS,
        tp.LOOPBACK,
    )
    assert knobs.KNOBS["MOEFUSE_MOE_COMM_VARIANT"].choices == ("auto", *mk.ONESHOT_VARIANTS)


def test_the_code_reads_knobs_at_call_time(clean_env):
    """Set after import, a knob changes the next call's choice (tiles of the comm kernels)."""
    from moefuse.comm import tiles

    assert tiles.comm_tile(4096).num_warps == 8 and tiles.resident_ctas_per_sm(8) == 2
    clean_env.setenv("MOEFUSE_COMM_ELEMS_PER_THREAD", "8")
    clean_env.setenv("MOEFUSE_COMM_CTAS_PER_SM", "3")
    assert tiles.comm_tile(4096).num_warps == 16 and tiles.resident_ctas_per_sm(8) == 3
    clean_env.setenv("MOEFUSE_COMM_ROWS_PER_CTA", "2")
    assert tiles.oneshot_variant(4) == tiles.OneshotVariant(rows_per_cta=2)
    clean_env.setenv("MOEFUSE_COMM_ELEMS_PER_THREAD", "many")
    with pytest.raises(ValueError, match="MOEFUSE_COMM_ELEMS_PER_THREAD must be"):
        tiles.comm_tile(4096)


# ----------------------------------------------------------------------------- declared once
def test_every_name_in_the_code_and_docs_is_declared():
    """Every MOEFUSE_* name that the package, the README or docs/ mention is a declared knob
    (``MOEFUSE_COMM_*``-style wildcards aside), and no module but knobs.py reads one from
    os.environ."""
    name = re.compile(r"MOEFUSE_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)")
    files = [*SRC.rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    seen = {}
    for f in files:
        for n in name.findall(f.read_text()):
            seen.setdefault(n, f)
    undeclared = {n: str(f) for n, f in seen.items() if n not in knobs.KNOBS}
    assert not undeclared, undeclared
    readers = re.compile(r"(os\.environ\.get|os\.getenv|os\.environ\[)\(?\s*[\"']MOEFUSE_")
    # (testing_ranks saves and restores the transport it sets for its threads)
    allowed = {"knobs.py", "testing_ranks.py"}
    direct = [
        str(f) for f in SRC.rglob("*.py") if f.name not in allowed and readers.search(f.read_text())
    ]
    assert not direct, direct


def test_docs_page_is_generated_from_the_declarations():
    page = (ROOT / "docs" / "knobs.md").read_text()
    assert page == knobs.markdown_page(), (
        'docs/knobs.md is out of date: python -c "from moefuse import knobs; '
        "print(knobs.markdown_page(), end='')\" > docs/knobs.md"
    )
    for n in knobs.KNOBS:
        assert f"`{n}`" in page


# ----------------------------------------------------------------------------- import time
def test_import_reads_no_knob():
    """A fresh interpreter imports every moefuse module with every knob set to a bad value and an
    undeclared MOEFUSE_* name set: no MOEFUSE_* variable is read (os.environ is watched), no
    warning is issued, and the first knob read then raises / warns."""
    code = r"""
import importlib, json, os, pkgutil, sys, warnings
reads = []
PKG = os.path.join(os.environ["PYTHONPATH"], "moefuse")
def by_moefuse():  # the reading code is moefuse's (tqdm, for one, reads all at import)
    f = sys._getframe(2)
    while f.f_code.co_filename in (os.__file__, "<frozen _collections_abc>", "<frozen os>"):
        f = f.f_back
    return f.f_code.co_filename.startswith(PKG)
class Watched(type(os.environ)):
    def __getitem__(self, key):
        if key.startswith("MOEFUSE_") and by_moefuse():
            reads.append(key)
        return super().__getitem__(key)
    def __iter__(self):
        if by_moefuse():
            reads.append("<iteration>")
        return super().__iter__()
os.environ.__class__ = Watched
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import moefuse
    skipped = []
    for m in pkgutil.walk_packages(moefuse.__path__, "moefuse."):
        if m.name.endswith("__main__"):  # runs the command line
            continue
        try:
            importlib.import_module(m.name)
        except ModuleNotFoundError as exc:  # an optional dependency (transformers, ...)
            if exc.name.startswith("moefuse"):
                raise
            skipped.append(m.name)
at_import = (list(reads), [str(w.message) for w in caught if "MOEFUSE" in str(w.message)])
from moefuse import knobs
with warnings.catch_warnings(record=True) as caught:
    try:
        knobs.get("MOEFUSE_FASTPATH")
        error = None
    except ValueError as exc:
        error = str(exc)
print(json.dumps({"at_import": at_import, "skipped": skipped, "error": error,
                  "read_after": reads[len(at_import[0]):],
                  "warned": [str(w.message) for w in caught]}))
"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MOEFUSE_")}
    env.update({n: BAD.get(k.kind, "x") for n, k in knobs.KNOBS.items()})
    env["MOEFUSE_NO_SUCH_KNOB"] = "1"
    env["PYTHONPATH"] = str(ROOT / "src")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["at_import"] == [[], []], got
    assert got["error"] is not None and got["read_after"], got  # the watch sees moefuse's reads
    assert "moefuse.knobs" not in got["skipped"]
    assert got["error"] == "MOEFUSE_FASTPATH must be 0 or 1, got 'yes'"
    assert len(got["warned"]) == 1 and "MOEFUSE_NO_SUCH_KNOB" in got["warned"][0]


# ----------------------------------------------------------------------------- unknown names
def test_an_unknown_name_is_warned_about_once(clean_env):
    clean_env.setenv("MOEFUSE_FASTPTH", "0")  # a typo
    with pytest.warns(UserWarning, match="MOEFUSE_FASTPTH .*did you mean MOEFUSE_FASTPATH"):
        knobs.get("MOEFUSE_FASTPATH")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        knobs.get("MOEFUSE_FASTPATH")
        assert knobs.warn_unknown() == []  # a workspace rescans: the same name stays quiet
    clean_env.setenv("MOEFUSE_ANOTHER", "1")
    with pytest.warns(UserWarning, match="MOEFUSE_ANOTHER"):
        assert knobs.warn_unknown() == ["MOEFUSE_ANOTHER"]
    assert knobs.unknown() == ["MOEFUSE_ANOTHER", "MOEFUSE_FASTPTH"]


def test_fastpath_reads_its_knob_at_the_first_call(clean_env):
    """MOEFUSE_FASTPATH set after import turns launch plans off at the next recording call."""
    import moefuse
    from moefuse import _fastpath as fp

    fp.clear()
    clean_env.setenv("MOEFUSE_FASTPATH", "0")
    x, w = torch.randn(2, 16).bfloat16(), torch.ones(16, dtype=torch.bfloat16)
    try:
        moefuse.rmsnorm(x, w, impl="reference")
        assert fp.ENABLED[0] is False
        assert all(not plans for plans in fp._caches)
    finally:
        fp.ENABLED[0] = True


# ----------------------------------------------------------------------------- ranks
def test_rank_agreement_check_names_the_knob_and_ranks():
    knobs.check_ranks_agree([{"MOEFUSE_A": "1"}, {"MOEFUSE_A": "1"}])
    knobs.check_ranks_agree([{}, {}, {}])
    with pytest.raises(RuntimeError) as err:
        knobs.check_ranks_agree(
            [
                {"MOEFUSE_ALLGATHER_LARGE": "fused"},
                {},
                {"MOEFUSE_ALLGATHER_LARGE": "fused", "MOEFUSE_TP_SPLIT_FOLD": "0"},
            ],
            "here",
        )
    msg = str(err.value)
    assert msg.startswith("here: knobs that every rank must set alike differ between ranks")
    assert "MOEFUSE_ALLGATHER_LARGE (ranks 0, 2: 'fused'; rank 1: unset)" in msg
    assert "MOEFUSE_TP_SPLIT_FOLD (ranks 0, 1: unset; rank 2: '0')" in msg


def _per_rank(values: dict[int, dict[str, str]]):
    """A shared_settings() that answers per loopback rank (the threads share os.environ, so a
    rank that sets a knob differently is simulated at the point where the workspace reads it)."""
    real = knobs.shared_settings

    def fake(environ=None):
        rank = int(threading.current_thread().name.rsplit("-", 1)[1])
        return {**real(environ), **values.get(rank, {})}

    return fake


def _create(rank, world_size):
    import moefuse

    try:
        ws = moefuse.AllReduceWorkspace(None, 4, 64, torch.float32, "cpu", timeout_s=30)
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    ws.close()
    return "created"


@pytest.mark.interpreter
def test_workspace_creation_compares_shared_knobs(monkeypatch):
    """On 2 loopback CPU ranks: equal knobs create the workspace; a shared knob set differently
    on one rank makes every rank raise the same error naming the knob and the ranks; a knob
    only one rank cannot parse makes every rank raise, naming that rank."""
    from moefuse.testing_ranks import run_loopback_ranks

    for name in [n for n in __import__("os").environ if n.startswith(knobs.PREFIX)]:
        monkeypatch.delenv(name)
    assert run_loopback_ranks(_create, 2, "cpu", timeout_s=120) == ["created", "created"]

    monkeypatch.setattr(
        knobs, "shared_settings", _per_rank({1: {"MOEFUSE_MOE_COMM_VARIANT": "split"}})
    )
    got = run_loopback_ranks(_create, 2, "cpu", timeout_s=120)
    assert got[0] == got[1], got
    assert got[0].startswith("RuntimeError: AllReduceWorkspace: knobs that every rank must set")
    assert "MOEFUSE_MOE_COMM_VARIANT (rank 0: unset; rank 1: 'split')" in got[0]

    real_check = knobs.check_all

    def bad_on_rank_one(environ=None):
        if threading.current_thread().name.endswith("-1"):
            raise ValueError("MOEFUSE_ALLGATHER_LOOKAHEAD must be an integer >= 1, got '0'")
        return real_check(environ)

    monkeypatch.setattr(knobs, "shared_settings", _per_rank({}))
    monkeypatch.setattr(knobs, "check_all", bad_on_rank_one)
    got = run_loopback_ranks(_create, 2, "cpu", timeout_s=120)
    assert (
        got[0]
        == got[1]
        == (
            "ValueError: AllReduceWorkspace: rank 1: "
            "MOEFUSE_ALLGATHER_LOOKAHEAD must be an integer >= 1, got '0'"
        )
    )
