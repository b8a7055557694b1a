"""``moefuse bench <family> --sweep KNOB=a,b``: one run per knob value, each under that knob and
labelled with it; bad sweep arguments end in one line naming them."""

from __future__ import annotations

import json
import os

import pytest

from moefuse import cli
from moefuse.bench import harness, sweep

ROWS = [{"M": 1, "note": "no time: no plot"}]


def test_split_sweeps_keeps_the_family_arguments():
    sweeps, rest = sweep.split_sweeps(
        [
            "--quick",
            "--sweep",
            "MOEFUSE_ALLGATHER_LARGE=fused,chunked",
            "--sweep",
            "--sweep=MOEFUSE_ALLGATHER_LOOKAHEAD=1,2",
            "--out",
            "x",
        ]
    )
    assert sweeps == [
        ("MOEFUSE_ALLGATHER_LARGE", ["fused", "chunked"]),
        ("MOEFUSE_ALLGATHER_LOOKAHEAD", ["1", "2"]),
    ]
    assert rest == ["--quick", "--sweep", "--out", "x"]  # a plain --sweep is the family's own
    assert sweep.combinations(sweeps) == [
        {"MOEFUSE_ALLGATHER_LARGE": a, "MOEFUSE_ALLGATHER_LOOKAHEAD": b}
        for a in ("fused", "chunked")
        for b in ("1", "2")
    ]


@pytest.mark.parametrize("spec, why", [
    ("MOEFUSE_NOPE=1", "MOEFUSE_NOPE is not a moefuse knob"),
    ("MOEFUSE_ALLGATHER_LOOKAHEAD=1,zero", "MOEFUSE_ALLGATHER_LOOKAHEAD must be an integer >= 1"),
    ("MOEFUSE_ALLGATHER_LOOKAHEAD=1,", "an empty value"),
])  # fmt: skip
def test_bad_sweeps_say_why_in_one_line(spec, why, capsys):
    assert cli.main(["bench", "norm", "--sweep", spec]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"moefuse bench norm: --sweep {spec}: ")
    assert why in out[0]
    with pytest.raises(ValueError, match="swept twice"):
        sweep.split_sweeps(["--sweep", "MOEFUSE_FASTPATH=0", "--sweep", "MOEFUSE_FASTPATH=1"])


def test_each_run_sees_its_knob_and_the_environment_is_restored(monkeypatch, tmp_path):
    for name in [n for n in os.environ if n.startswith("MOEFUSE_")]:
        monkeypatch.delenv(name)
    seen = []

    def family_main(argv):
        seen.append(
            (
                os.environ.get("MOEFUSE_MOE_COMM_VARIANT"),
                os.environ.get("MOEFUSE_MOE_COMM_SPLIT_CTAS"),
                argv,
            )
        )
        harness.save_results("fam", ROWS, {"gpu": "cpu"}, tmp_path)
        return 1 if len(seen) == 2 else 0

    sweeps = [
        ("MOEFUSE_MOE_COMM_VARIANT", ["fused", "split"]),
        ("MOEFUSE_MOE_COMM_SPLIT_CTAS", ["4"]),
    ]
    assert sweep.run(family_main, sweeps, ["--quick"]) == 1
    assert seen == [("fused", "4", ["--quick"]), ("split", "4", ["--quick"])]
    assert "MOEFUSE_MOE_COMM_VARIANT" not in os.environ
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert names == [
        "fam-cpu-moe_comm_variant-fused-moe_comm_split_ctas-4.json",
        "fam-cpu-moe_comm_variant-split-moe_comm_split_ctas-4.json",
    ]
    data = json.loads((tmp_path / names[1]).read_text())
    assert data["meta"]["knobs"] == {
        "MOEFUSE_MOE_COMM_VARIANT": "split",
        "MOEFUSE_MOE_COMM_SPLIT_CTAS": "4",
    }
    label = "MOEFUSE_MOE_COMM_VARIANT=split MOEFUSE_MOE_COMM_SPLIT_CTAS=4"
    assert data["rows"][0]["knobs"] == label
    # without knobs set: the plain file name and no label
    harness.save_results("fam", ROWS, {"gpu": "cpu"}, tmp_path)
    plain = json.loads((tmp_path / "fam-cpu.json").read_text())
    assert "knobs" not in plain["meta"] and "knobs" not in plain["rows"][0]
