"""`python -m moefuse env`: versions, devices, peer access, PDL and what impl='auto' picks."""

import json

import pytest
import torch

from moefuse import cli, env

FAMILIES = {"norm", "moe", "quant"}


def test_env_text_and_json(capsys, monkeypatch):
    monkeypatch.delenv("MOEFUSE_COMM_TRANSPORT", raising=False)
    assert cli.main(["env"]) == 0
    text = capsys.readouterr().out
    assert "versions: moefuse" in text and f"torch {torch.__version__}" in text
    assert "transformers" in text and "triton" in text
    assert "impl='auto' per family:" in text and "comm.allreduce_*" in text
    assert cli.main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["versions"]["torch"] == torch.__version__
    assert {r["family"] for r in info["families"]} == FAMILIES
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert len(info["devices"]) == n and len(info["peer_access"]) == n
    assert info["comm"]["transport_order"] == ["symm_mem", "cuda_ipc"]


@pytest.mark.interpreter
def test_env_on_cpu_with_the_interpreter():
    """CPU tensors: auto runs the reference; every probe's sample is accepted by its
    ``supports_*`` helper (a wrong sample would report a kernel as unsupported)."""
    rows = env.family_paths(torch.device("cpu"))
    assert len(rows) >= 8
    for r in rows:
        assert r["supports"], r
        assert r["auto"] == "reference"
        assert "interpreter" in r["why"]


def test_env_on_cpu_without_the_interpreter(monkeypatch):
    """A CPU-only machine without TRITON_INTERPRET: the reference, with the reason why the
    kernels cannot run (the decision reads the variable at call time; `make test`'s wheel check
    runs the `moefuse env` console script in such an environment)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for r in env.family_paths(torch.device("cpu")):
        assert r["auto"] == "reference" and "TRITON_INTERPRET=1" in r["why"], r


def test_comm_path_by_peer_access():
    devs = [{"kernels": "supported"}] * 2
    ok = env.comm_path([[None, True], [True, None]], devs)
    assert "peer kernels" in ok["path"] and "one-shot" in ok["path"]
    assert "lack peer access" in env.comm_path([[None, False], [True, None]], devs)["path"]
    slow = [{"kernels": "device capability (8, 0) is below SM90"}] * 2
    assert "below SM90" in env.comm_path([[None, True], [True, None]], slow)["path"]
    assert "no local peers" in env.comm_path([], [])["path"]


@pytest.mark.gpu
def test_env_on_gpu():
    info = env.collect()
    n = torch.cuda.device_count()
    assert len(info["devices"]) == n and len(info["peer_access"]) == n
    for d in info["devices"]:
        sm90 = tuple(d["capability"]) >= (9, 0)
        assert d["pdl"] == sm90 and (d["kernels"] == "supported") == sm90
    if info["devices"][0]["kernels"] == "supported":
        assert all(r["auto"] == "triton" for r in info["families"]), info["families"]
    if n >= 2 and all(v for row in info["peer_access"] for v in row if v is not None):
        assert "peer kernels" in info["comm"]["path"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without GPU")
@pytest.mark.parametrize(
    "family", ["norm", "quant", "moe", "moe-experts", "all-reduce", "overhead"]
)
def test_bench_without_gpu_says_what_is_missing(family, capsys):
    from moefuse.cli import main

    assert main(["bench", family]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"moefuse bench {family}: needs ")
    assert "GPU" in out[0]


def test_bench_summary_outside_the_repository(tmp_path, monkeypatch, capsys):
    from moefuse.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["bench", "summary"]) == 2
    assert "pass --dir" in capsys.readouterr().out


def test_env_prints_the_knobs_set(capsys, monkeypatch):
    """Knobs set are listed with their parsed value (an invalid one shown, not raised; * marks
    those every rank must share), and undeclared MOEFUSE_* names are named."""
    import os

    for name in [n for n in os.environ if n.startswith("MOEFUSE_")]:
        monkeypatch.delenv(name)
    assert cli.main(["env"]) == 0
    assert "MOEFUSE_* knobs: none set" in capsys.readouterr().out
    monkeypatch.setenv("MOEFUSE_ALLGATHER_LARGE", "chunked")
    monkeypatch.setenv("MOEFUSE_FASTPATH", "0")
    monkeypatch.setenv("MOEFUSE_TP_SPLIT_FOLD", "yes")
    monkeypatch.setenv("MOEFUSE_NOT_A_KNOB", "1")
    assert cli.main(["env"]) == 0
    text = capsys.readouterr().out
    assert "MOEFUSE_ALLGATHER_LARGE*=chunked  -> 'chunked'" in text
    assert "MOEFUSE_FASTPATH=0  -> False" in text
    assert "MOEFUSE_TP_SPLIT_FOLD*=yes  INVALID: MOEFUSE_TP_SPLIT_FOLD must be 0 or 1" in text
    assert "MOEFUSE_NOT_A_KNOB: not a moefuse knob, ignored" in text
    assert cli.main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["knobs"]
    assert info["set"]["MOEFUSE_FASTPATH"] == {"raw": "0", "shared": False, "value": False}
    assert "error" in info["set"]["MOEFUSE_TP_SPLIT_FOLD"]
    assert info["unknown"] == ["MOEFUSE_NOT_A_KNOB"]
