"""Test set-up. Without a CUDA GPU the Triton kernels run in the interpreter, which must be
switched on before triton is imported by any kernel module."""

import os
import zlib

# loopback ranks share one CUDA context, where a kernel module loaded lazily at its first use
# waits for a peer's running kernel (moefuse.testing_ranks): every module is loaded at start-up
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
for _var, _val in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_var, _val)

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--rank-processes",
        action="store_true",
        help="run every multi-rank CPU test as processes (real gloo groups, shared-memory "
        "workspaces) instead of threads (tests/comm_mp.py)",
    )


def pytest_configure(config):
    if config.getoption("--rank-processes"):
        import comm_mp

        comm_mp.FORCE_PROCESSES = True


#: what a test calls that makes it ``slow``: it runs a group of ranks (threads or processes) or a
#: script in a fresh interpreter, each seconds of Triton-interpreter work on a CPU
RANK_RUNNERS = frozenset({"run_group", "run_group_one_killed", "run_loopback_ranks",
                          "run_check_script"})  # fmt: skip


def _runs_ranks(item) -> bool:
    code = getattr(getattr(item, "function", None), "__code__", None)
    return code is not None and not RANK_RUNNERS.isdisjoint(code.co_names)


def pytest_collection_modifyitems(config, items):
    """GPU tests skipped without a GPU and interpreter tests with one; tests whose body calls a
    rank runner (:data:`RANK_RUNNERS`) marked ``slow``, so ``-m "not slow"`` is the quick
    subset."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 machines)")
    for item in items:
        if "slow" not in item.keywords and _runs_ranks(item):
            item.add_marker(pytest.mark.slow)
        if not HAS_GPU and ("gpu" in item.keywords or "multigpu" in item.keywords):
            item.add_marker(skip_gpu)
        if HAS_GPU and "interpreter" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="interpreter tests run on CPU-only machines"))


@pytest.fixture(scope="session", autouse=True)
def _interpreter_session():
    """Under the interpreter, every launch patches triton.language once (not at every
    device-function call) and ranks as threads find the interpreter ready
    (moefuse.testing_ranks.interpreter_session)."""
    if HAS_GPU:
        yield
        return
    from moefuse.testing_ranks import interpreter_session

    with interpreter_session():
        yield


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Tests change tile policies and thresholds at run time: no plan may outlive a test."""
    from moefuse import _fastpath

    _fastpath.clear()
    yield
    _fastpath.clear()


@pytest.fixture(autouse=True)
def _seeded_per_test(request):
    """Every test starts from its own fixed seed (from its id), so the inputs a test draws from
    torch's global generator do not depend on which tests ran before it in the same worker:
    a failure reproduces with the test alone."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def seed():
    torch.manual_seed(1234)
    return 1234
