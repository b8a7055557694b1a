"""``moefuse bench overhead``'s bar lines: which time each communication row is held to."""

from moefuse.bench.overhead import add_ratios


def _row(op, wall, cpu, ranks):
    return {
        "op": op,
        "impl": "moefuse",
        "us_per_call": wall,
        "thread_cpu_us_per_call": cpu,
        "launch_plan": "replayed",
        "P": 2,
        "ranks": ranks,
    }


def test_loopback_rows_are_held_to_the_threads_cpu_time_and_keep_the_wall_ratio():
    rows = [
        _row("allreduce_residual_rmsnorm", 280.0, 20.0, "loopback"),
        _row("moe_allreduce_residual_rmsnorm", 476.0, 28.0, "loopback"),
        _row("moe_finalize_allreduce_residual_rmsnorm", 300.0, 32.0, "loopback"),
    ]
    lines = add_ratios(rows)
    assert rows[1]["x_allreduce_residual_rmsnorm"] == 28.0 / 20.0
    assert rows[1]["x_allreduce_residual_rmsnorm_wall"] == 476.0 / 280.0
    assert lines[1].startswith("PASS moe_allreduce_residual_rmsnorm [loopback]")
    assert lines[2].startswith("FAIL moe_finalize_allreduce_residual_rmsnorm [loopback]")


def test_rows_of_one_process_per_gpu_are_held_to_the_wall_time():
    rows = [
        _row("allreduce_residual_rmsnorm", 20.0, 19.0, "gpus"),
        _row("moe_allreduce_residual_rmsnorm", 32.0, 20.0, "gpus"),
    ]
    lines = add_ratios(rows)
    assert rows[1]["x_allreduce_residual_rmsnorm"] == 32.0 / 20.0
    assert lines[1].startswith("FAIL")
