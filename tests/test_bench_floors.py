"""Every floor a benchmark prints comes from the GPU the run is on: the datasheet bandwidth
table by device name (CPU, no GPU needed)."""

import pytest

from moefuse.bench import harness


@pytest.mark.parametrize(
    "name, label, tbs",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 3.35),
        ("NVIDIA H100 PCIe", "H100 PCIe", 2.0),
        ("NVIDIA H100 NVL", "H100 NVL", 3.9),
        ("NVIDIA H200", "H200", 4.8),
        ("NVIDIA H200 NVL", "H200", 4.8),
        ("NVIDIA H20", "H20", 4.0),
        ("NVIDIA B200", "B200", 8.0),
        ("NVIDIA GB200", "GB200", 8.0),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB", 2.039),
    ],
)
def test_datasheet_bandwidth_by_device_name(name, label, tbs):
    assert harness.datasheet_gpu(name) == (label, tbs)
    assert harness.datasheet_tbs(name) == tbs
    line = harness.bandwidth_line(2.5, name)
    assert f"{tbs:.2f} TB/s ({label})" in line and "2.50 TB/s" in line


@pytest.mark.parametrize("name", ["NVIDIA H100", "NVIDIA RTX PRO 6000", "Tesla V100-SXM2-16GB"])
def test_unknown_gpu_gets_no_floor_rather_than_another_gpus(name):
    assert harness.datasheet_gpu(name) is None and harness.datasheet_tbs(name) is None
    line = harness.bandwidth_line(2.5, name)
    assert "unknown" in line and "2.50 TB/s" in line and "4.80" not in line


def test_moe_experts_bench_reads_the_table_not_a_constant():
    import inspect

    from moefuse.bench import moe_experts

    src = inspect.getsource(moe_experts)
    assert "datasheet_gpu()" in src and "4.8" not in src and "PEAK_TBS" not in src
