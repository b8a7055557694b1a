"""The multi-GPU benchmarks' process plumbing (moefuse.bench.ranks), without a GPU."""

import argparse

from moefuse.bench import ranks

CALLS = []


def _worker(rank, world_size, args, init_method):
    CALLS.append((rank, world_size, args.tag, init_method))


def test_under_torchrun_the_worker_runs_in_place(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    CALLS.clear()
    assert ranks.run_ranks(_worker, argparse.Namespace(world_size=2, tag="t")) == 0
    assert CALLS == [(1, 2, "t", None)]


def test_too_few_gpus_is_a_clear_refusal(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(ranks.torch.cuda, "device_count", lambda: 1)
    assert ranks.run_ranks(_worker, argparse.Namespace(world_size=2, tag="t")) == 2
    assert "needs 2 GPUs, found 1" in capsys.readouterr().out


def test_token_and_width_lists():
    args = argparse.Namespace(tokens="", hidden="", quick=True)
    assert ranks.token_and_width_lists(args, [1, 2, 3], [7168], [1]) == ([1], [4096])
    args = argparse.Namespace(tokens="5,6", hidden="2880", quick=False)
    assert ranks.token_and_width_lists(args, [1], [4096], [1]) == ([5, 6], [2880])
