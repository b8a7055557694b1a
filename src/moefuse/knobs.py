"""Every ``MOEFUSE_*`` environment variable, declared once and parsed one way.

A knob is read when a call or a workspace needs it (:func:`get`), never at import, so setting a
variable after ``import moefuse`` takes effect at the next call that reads it (launch plans
record what the knobs decided: ``moefuse._fastpath.clear()`` after changing one that a
recorded call already read).

Parsing, the same for every knob:

* unset or empty: the knob's ``default`` (``None`` where the op chooses per call, as its text
  says);
* ``bool``: ``0`` or ``1``;
* ``int``: a decimal integer, at least ``minimum`` and, where ``choices`` is given, one of them;
* ``choice``: one of ``choices``;
* ``str``: any text (the other kinds ignore blanks around the value).

Anything else raises ``ValueError`` naming the variable, the value and what it accepts.

Knobs marked ``shared`` change grids, slot schedules or transports of the communication
kernels: every rank must set them alike. :class:`moefuse.comm.workspace.AllReduceWorkspace`
exchanges their values when it is created and raises ``RuntimeError`` naming the knob and the
ranks that differ (:func:`check_ranks_agree`).

A ``MOEFUSE_*`` variable that is not declared here (a typo, or a knob that no longer exists) is
reported by one ``UserWarning`` per name, at the first knob read, at workspace creation and by
``moefuse env``.

``python -m moefuse env`` prints the knobs that are set; :func:`markdown_page` is docs/knobs.md
(a test keeps the two equal).
"""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass

PREFIX = "MOEFUSE_"
KINDS = ("bool", "int", "choice", "str")


@dataclass(frozen=True)
class Knob:
    """One environment variable: ``name``, ``kind`` (one of :data:`KINDS`), the value
    :func:`get` returns when it is unset (``default``), what it does (``doc``), whether every
    rank must set it alike (``shared``), the accepted values (``choices``: strings of a
    ``choice``, integers of an ``int``), the smallest integer accepted (``minimum``) and
    ``power_of_two`` (an ``int`` that must be 0 or a power of two)."""

    name: str
    kind: str
    default: object
    doc: str
    shared: bool
    choices: tuple = ()
    minimum: int | None = None
    power_of_two: bool = False

    def accepts(self) -> str:
        """What the knob accepts, in words (error messages and the docs table)."""
        if self.kind == "bool":
            return "0 or 1"
        if self.kind == "choice" or self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        if self.kind == "int":
            text = "an integer" if self.minimum is None else f"an integer >= {self.minimum}"
            return text + (" (0 or a power of two)" if self.power_of_two else "")
        return "text"


def _declare(*knobs: Knob) -> dict[str, Knob]:
    table = {}
    for k in knobs:
        if not k.name.startswith(PREFIX) or k.kind not in KINDS or k.name in table:
            raise AssertionError(f"bad knob declaration {k.name!r}")
        table[k.name] = k
    return table


KNOBS: dict[str, Knob] = _declare(
    # ----------------------------------------------------------------------------- host path
    Knob(
        "MOEFUSE_FASTPATH",
        "bool",
        True,
        "Eager launch plans (moefuse._fastpath): 0 turns them off; read at the first call "
        "of an op.",
        shared=False,
    ),
    # ----------------------------------------------------------------------------- comm core
    Knob(
        "MOEFUSE_COMM_TRANSPORT",
        "choice",
        "auto",
        "Peer buffers of a workspace created with transport=None: auto = symmetric memory, "
        "else CUDA IPC; loopback = ranks are threads of one process (tests, benchmarks).",
        shared=True,
        choices=("auto", "symm_mem", "cuda_ipc", "loopback"),
    ),
    Knob(
        "MOEFUSE_COMM_ELEMS_PER_THREAD",
        "int",
        16,
        "Row elements per thread of the communication tiles: num_warps = BLOCK / (32 x this), "
        "within [4, 32].",
        shared=True,
        minimum=1,
    ),
    Knob(
        "MOEFUSE_COMM_CTAS_PER_SM",
        "int",
        0,
        "Co-resident CTAs per SM that cap the peer kernels' grids; 0 = the estimate from the "
        "tile's warps.",
        shared=True,
        minimum=0,
    ),
    Knob(
        "MOEFUSE_COMM_ONESHOT_PREFETCH",
        "bool",
        None,
        "All-reduce one-shot: 1 = the prefetch pipeline (rows loaded two ahead). Setting any "
        "of the three one-shot knobs replaces the measured per-M default.",
        shared=True,
    ),
    Knob(
        "MOEFUSE_COMM_ROWS_PER_CTA",
        "int",
        None,
        "All-reduce one-shot: token rows per CTA (grid = ceil(M / this), capped by the "
        "co-resident CTAs).",
        shared=True,
        minimum=1,
    ),
    Knob(
        "MOEFUSE_COMM_ONESHOT_WARPS",
        "int",
        None,
        "All-reduce one-shot: warps of its kernels; 0 = the tile's.",
        shared=True,
        choices=(0, 1, 2, 4, 8, 16, 32),
    ),
    # ----------------------------------------------------------------------------- all-gather
    Knob(
        "MOEFUSE_ALLGATHER_ONE_LAUNCH",
        "bool",
        None,
        "All-gather + op at M <= 64: 0 = two launches; 1 = one launch wherever the decode "
        "kernel can run (also the wide NVFP4 rows that default to two).",
        shared=True,
    ),
    Knob(
        "MOEFUSE_ALLGATHER_DECODE",
        "choice",
        None,
        "Where the one-launch decode kernel loads the op's parameters and reads the rows; "
        "unset = the measured choice per op.",
        shared=True,
        choices=("late", "early", "slots"),
    ),
    Knob(
        "MOEFUSE_ALLGATHER_LARGE",
        "choice",
        None,
        "All-gather + op above the decode range: fused = one persistent launch (the default), "
        "chunked = two launches with the chunk pipeline. Set to fused, it also runs the "
        "persistent kernel at M <= 64 where the decode kernel cannot.",
        shared=True,
        choices=("fused", "chunked"),
    ),
    Knob(
        "MOEFUSE_ALLGATHER_CHUNK_ROWS",
        "int",
        None,
        "Rows per chunk of the two-launch pipeline; 0 = no pipelining; unset = 4 chunks "
        "from 2048 tokens.",
        shared=True,
        minimum=0,
    ),
    Knob(
        "MOEFUSE_ALLGATHER_PERSISTENT",
        "choice",
        None,
        "Where the persistent kernel reads each tile: from the gathered buffer, early "
        "(parameters per tile) or straight from the slots; unset = per op and width.",
        shared=True,
        choices=("gathered", "early", "slots"),
    ),
    Knob(
        "MOEFUSE_ALLGATHER_LOOKAHEAD",
        "int",
        None,
        "Tiles the persistent kernel pushes ahead of the one it receives; unset = 1.",
        shared=True,
        minimum=1,
    ),
    Knob(
        "MOEFUSE_ALLGATHER_FUSED_CTAS_PER_SM",
        "int",
        None,
        "CTAs per SM of the persistent kernel (still capped by what the compiled kernel "
        "fits); unset = per op.",
        shared=True,
        minimum=1,
    ),
    Knob(
        "MOEFUSE_ALLGATHER_FUSED_MAXNREG",
        "int",
        0,
        "Register cap of the persistent kernel, for experiments; 0 = none.",
        shared=True,
        minimum=0,
    ),
    Knob(
        "MOEFUSE_ALLGATHER_FUSED_UNROLL",
        "bool",
        None,
        "Stepped rows of the persistent kernel: 0 = looped, 1 = unrolled; unset = per op.",
        shared=True,
    ),
    Knob(
        "MOEFUSE_ALLGATHER_FUSED_GRID",
        "int",
        0,
        "A cap on the persistent kernel's grid (tests give each CTA several tiles); 0 = none.",
        shared=True,
        minimum=0,
    ),
    # ----------------------------------------------------------------------------- expert norm
    Knob(
        "MOEFUSE_TP_SPLIT_FOLD",
        "bool",
        True,
        "TP per-expert norm, slot_oneshot: 0 = one CTA folds each token instead of its CTAs "
        "folding column slices together.",
        shared=True,
    ),
    Knob(
        "MOEFUSE_EP_PREFETCH_ROWS",
        "bool",
        None,
        "EP per-expert norm: 1 = request a token's K rows before normalizing any, at every M; "
        "0 = slot by slot; unset = rows first when every CTA has one token.",
        shared=True,
    ),
    # ----------------------------------------------------------------------------- MoE reduction
    Knob(
        "MOEFUSE_MOE_COMM_CTAS_PER_SM",
        "int",
        None,
        "Co-resident CTAs per SM of the MoE reduction / finalize peer kernels; unset = the "
        "measured table per M and H.",
        shared=True,
        choices=(1, 2, 4),
    ),
    Knob(
        "MOEFUSE_MOE_COMM_VARIANT",
        "choice",
        "auto",
        "One-shot MoE reduction kernel: fused (one CTA per row) or split (several CTAs per "
        "row, decode); auto = split up to 64 tokens.",
        shared=True,
        choices=("auto", "fused", "split"),
    ),
    Knob(
        "MOEFUSE_MOE_COMM_SPLIT_CTAS",
        "int",
        0,
        "CTAs per row of the split variant (a power of two dividing the row tile); 0 = the "
        "measured default.",
        shared=True,
        minimum=0,
        power_of_two=True,
    ),
    # ----------------------------------------------------------------------------- FP8 products
    Knob(
        "MOEFUSE_FP8_ACCUMULATION",
        "choice",
        "block",
        "FP8 experts and fp8_linear: block = the tensor cores carry each 128-wide K-block's sum "
        "themselves (fastest; DeepGEMM's numerics); k32 = every 32-wide MMA step is added in "
        "FP32 (closer to the exact formula; 1-3 % slower at decode, 2 x at 2,048 tokens); "
        "fp16 = the codes widened exactly to FP16 for the FP16 MMA (exact products, FP32 sums: "
        "about 20 x closer to the exact formula than block; 8-44 % slower at decode, 1.5-1.8 x "
        "at 2,048 tokens).",
        shared=False,
        choices=("block", "k32", "fp16"),
    ),
    Knob(
        "MOEFUSE_FP8_LINEAR_FUSED_REDUCE",
        "bool",
        None,
        "fp8_linear at few rows, whose K chunks run as programs of their own: 1 = each row x "
        "column tile's last program adds the chunk sums (one launch), 0 = a second kernel adds "
        "them; the same bits. Unset: the policy's default (moefuse.moe.tiles."
        "LINEAR_FP8_FUSED_REDUCE).",
        shared=False,
    ),
    # ----------------------------------------------------------------------------- benchmarks
    Knob(
        "MOEFUSE_COMMIT",
        "str",
        None,
        "The commit recorded in benchmark results instead of git's HEAD (a copied tree, "
        "an installed package).",
        shared=False,
    ),
)


# ----------------------------------------------------------------------------- parsing
def parse(name: str, raw: str | None):
    """The value of knob ``name`` for the text ``raw`` (None or "" = unset: the default);
    ValueError naming the knob when ``raw`` is not accepted; KeyError for an undeclared name."""
    knob = KNOBS[name]
    if raw is None or raw == "":
        return knob.default
    if knob.kind == "str":
        return raw
    text = raw.strip()  # surrounding blanks are forgiven, the same for every kind
    if knob.kind == "bool":
        if text not in ("0", "1"):
            raise ValueError(f"{name} must be {knob.accepts()}, got {raw!r}")
        return text == "1"
    if knob.kind == "choice":
        if text not in knob.choices:
            raise ValueError(f"{name} must be {knob.accepts()}, got {raw!r}")
        return text
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be {knob.accepts()}, got {raw!r}") from None
    bad = (
        (knob.choices and value not in knob.choices)
        or (knob.minimum is not None and value < knob.minimum)
        or (knob.power_of_two and value & (value - 1))
    )
    if bad:
        raise ValueError(f"{name} must be {knob.accepts()}, got {raw!r}")
    return value


def get(name: str):
    """Knob ``name`` from ``os.environ`` now (:func:`parse`). The first read also warns about
    undeclared ``MOEFUSE_*`` variables (:func:`warn_unknown`)."""
    if not _scanned[0]:
        warn_unknown()
    return parse(name, os.environ.get(name))


def is_set(name: str) -> bool:
    """Whether knob ``name`` is set to a non-empty value (KeyError for an undeclared name)."""
    KNOBS[name]  # noqa: B018 - an undeclared name is a programming error
    return os.environ.get(name, "") != ""


def settings(environ=None) -> dict[str, str]:
    """Declared knobs set (non-empty) in ``environ`` (default ``os.environ``): name -> text."""
    environ = os.environ if environ is None else environ
    return {n: environ[n] for n in KNOBS if environ.get(n, "")}


def check_all(environ=None) -> dict[str, object]:
    """Parse every declared knob set in ``environ``: name -> value; ValueError naming the first
    knob that does not parse."""
    return {n: parse(n, raw) for n, raw in settings(environ).items()}


# ----------------------------------------------------------------------------- unknown names
_scanned = [False]
_warned: set[str] = set()


def unknown(environ=None) -> list[str]:
    """``MOEFUSE_*`` names in ``environ`` (default ``os.environ``) that no knob declares."""
    environ = os.environ if environ is None else environ
    return sorted(n for n in environ if n.startswith(PREFIX) and n not in KNOBS)


def warn_unknown() -> list[str]:
    """Warn (``UserWarning``) once per process about each undeclared ``MOEFUSE_*`` variable in
    ``os.environ``, naming the closest declared knob; returns the names warned about now."""
    _scanned[0] = True
    new = [n for n in unknown() if n not in _warned]
    for n in new:
        _warned.add(n)
        close = difflib.get_close_matches(n, KNOBS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.warn(
            f"{n} is set but moefuse has no such knob{hint}; it is ignored "
            "(`python -m moefuse env` lists the knobs)",
            UserWarning,
            stacklevel=3,
        )
    return new


# ----------------------------------------------------------------------------- ranks
def shared_settings(environ=None) -> dict[str, str]:
    """The ``shared`` knobs set in ``environ`` (default ``os.environ``): what the ranks of a
    workspace exchange and compare."""
    return {n: raw for n, raw in settings(environ).items() if KNOBS[n].shared}


def check_ranks_agree(per_rank: list[dict[str, str]], where: str = "") -> None:
    """Raise RuntimeError when the ranks' :func:`shared_settings` (``per_rank[r]`` of rank r)
    differ, naming each knob that differs and which ranks set which value."""
    names = sorted({n for s in per_rank for n in s})
    problems = []
    for n in names:
        by_value: dict[str, list[int]] = {}
        for rank, s in enumerate(per_rank):
            by_value.setdefault(s.get(n, ""), []).append(rank)
        if len(by_value) > 1:
            sides = "; ".join(
                f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: "
                + (repr(v) if v else "unset")
                for v, r in by_value.items()
            )
            problems.append(f"{n} ({sides})")
    if problems:
        prefix = f"{where}: " if where else ""
        raise RuntimeError(
            f"{prefix}knobs that every rank must set alike differ between ranks: "
            + ", ".join(problems)
        )


# ----------------------------------------------------------------------------- docs
def markdown_page() -> str:
    """docs/knobs.md: every knob as a row of a Markdown table (a test keeps the file equal to
    it and says how to regenerate the file)."""
    lines = [
        "# Environment knobs",
        "",
        "Generated from the declarations in `src/moefuse/knobs.py` (edit those, not this page): "
        "`python -c \"from moefuse import knobs; print(knobs.markdown_page(), end='')\" > "
        "docs/knobs.md`; `tests/test_knobs.py` checks that the two agree.",
        "",
        "Every knob keeps the bits of every op; the defaults come from the H200 measurements in "
        '`notes/`. Unset or empty means the default ("op\'s choice": the op decides per call). '
        "A knob is read when a call or a workspace needs it, never at import; an invalid value "
        'raises `ValueError` naming the variable. Knobs marked "yes" in the fourth column '
        "must be set alike on every rank: a communication workspace compares them when it is "
        "created and raises `RuntimeError` naming the knob and the ranks that differ. A "
        "`MOEFUSE_*` variable that is not listed here is reported by one warning. "
        "`python -m moefuse env` prints the knobs that are set.",
        "",
        "| variable | accepts | unset | same on every rank | what it does |",
        "|---|---|---|---|---|",
    ]
    for k in KNOBS.values():
        default = (
            "op's choice"
            if k.default is None
            else (str(int(k.default)) if k.kind == "bool" else str(k.default))
        )
        lines.append(
            f"| `{k.name}` | {k.accepts()} | {default} | {'yes' if k.shared else 'no'} | {k.doc} |"
        )
    return "\n".join(lines) + "\n"
