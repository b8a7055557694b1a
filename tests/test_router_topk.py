"""The fused router top-k on CPU (kernel in Triton's interpreter): against Python loops and the
torch reference at odd expert counts and K, ties, NaN rows, row invariance (a row's bits do not
depend on the batch), caller outputs, the reference path and bad input."""

import math

import pytest
import torch

import moefuse
from moefuse._runtime import kernel_device_reason
from moefuse.moe.reference import router_topk_reference
from moefuse.testing import assert_bitwise_equal, expect_value_error, poison_

pytestmark = pytest.mark.interpreter


def _loops(logits, top_k, scoring, renormalize):
    """(weights, ids) as lists, one row at a time in Python floats."""
    weights, ids = [], []
    for row in logits.float().tolist():
        if scoring == "softmax":
            top = max(row)
            p = [math.exp(v - top) for v in row]
            scores = [v / sum(p) for v in p]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        chosen = sorted(range(len(row)), key=lambda e: (-scores[e], e))[:top_k]
        w = [scores[e] for e in chosen]
        if renormalize:
            w = [s / sum(w) for s in w]
        weights.append(w)
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids)


@pytest.mark.parametrize(
    "m,e,k,scoring,renormalize,wdtype,idtype",
    [
        (5, 128, 8, "softmax", True, torch.bfloat16, torch.int64),
        (9, 60, 4, "softmax", False, torch.float32, torch.int32),
        (3, 8, 2, "sigmoid", True, torch.float16, torch.int32),
        (17, 256, 8, "softmax", True, torch.float32, torch.int64),
        (1, 7, 7, "softmax", True, torch.float32, torch.int32),
        (2, 1, 1, "sigmoid", False, torch.float32, torch.int32),
    ],
)
def test_router_topk_matches_loops(m, e, k, scoring, renormalize, wdtype, idtype):
    g = torch.Generator().manual_seed(e + k)
    logits = (torch.randn(m, e, generator=g) * 3).to(torch.bfloat16)
    w = poison_(torch.empty(m, k, dtype=wdtype))
    ids = poison_(torch.empty(m, k, dtype=idtype))
    got = moefuse.router_topk(
        logits,
        k,
        scoring=scoring,
        renormalize=renormalize,
        weights_dtype=wdtype,
        ids_dtype=idtype,
        weights_out=w,
        ids_out=ids,
        impl="triton",
    )
    assert got[0] is w and got[1] is ids
    want_w, want_ids = _loops(logits, k, scoring, renormalize)
    assert torch.equal(ids.long(), want_ids)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[wdtype]
    torch.testing.assert_close(w.float(), want_w, rtol=tol, atol=1e-7)
    ref_w, ref_ids = router_topk_reference(logits, k, scoring, renormalize, wdtype, idtype)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w.float(), ref_w.float(), rtol=tol, atol=1e-7)


def test_ties_take_the_lower_id_and_nan_ranks_last():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits[0, 9] = logits[0, 3] = 9.0  # tied best scores
    logits[1] = 0.0  # every score tied
    logits[2, :] = float("nan")  # a row of NaN scores
    logits[3, 5] = float("nan")  # one NaN logit: softmax makes the whole row NaN
    w, ids = moefuse.router_topk(logits, 4, impl="triton")
    assert ids[0, :2].tolist() == [3, 9]
    assert ids[1].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(w[1], torch.full((4,), 0.25))
    for row in (2, 3):
        assert ids[row].tolist() == [0, 1, 2, 3] and torch.isnan(w[row]).all()
    ref_w, ref_ids = router_topk_reference(logits, 4)
    assert torch.equal(ids, ref_ids)
    sig_w, sig_ids = moefuse.router_topk(logits, 4, scoring="sigmoid", impl="triton")
    assert 5 not in sig_ids[3].tolist()  # sigmoid: only the NaN logit's score is NaN, ranked last


def test_sigmoid_of_infinite_logits():
    logits = torch.zeros(2, 8)
    logits[0, 3] = float("inf")  # score 1
    logits[1, 5] = float("-inf")  # score 0
    logits[1, 2] = 2.0
    w, ids = moefuse.router_topk(logits, 3, scoring="sigmoid", renormalize=False, impl="triton")
    ref_w, ref_ids = router_topk_reference(logits, 3, "sigmoid", False)
    assert ids.tolist() == ref_ids.tolist() == [[3, 0, 1], [2, 0, 1]]
    assert_bitwise_equal(w, ref_w, "sigmoid weights")
    w8, ids8 = moefuse.router_topk(
        logits[1:], 8, scoring="sigmoid", renormalize=False, impl="triton"
    )
    assert ids8[0, -1] == 5 and w8[0, -1] == 0.0


def test_a_rows_bits_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(37, 128, generator=g).to(torch.bfloat16)
    w, ids = moefuse.router_topk(logits, 8, weights_dtype=torch.bfloat16, impl="triton")
    for rows in (slice(0, 1), slice(5, 6), slice(16, 33), slice(36, 37)):
        part_w, part_ids = moefuse.router_topk(
            logits[rows], 8, weights_dtype=torch.bfloat16, impl="triton"
        )
        assert_bitwise_equal(part_w, w[rows], f"weights of rows {rows}")
        assert torch.equal(part_ids, ids[rows])
    # strided rows (a view of a wider buffer) give the same bits
    wide = torch.zeros(37, 160, dtype=torch.bfloat16)
    wide[:, :128] = logits
    sw, sids = moefuse.router_topk(wide[:, :128], 8, weights_dtype=torch.bfloat16, impl="triton")
    assert_bitwise_equal(sw, w, "strided rows")
    assert torch.equal(sids, ids)


def test_reference_path_and_empty_batch():
    logits = torch.randn(6, 12, generator=torch.Generator().manual_seed(3))
    w, ids = moefuse.router_topk(logits, 3, impl="reference")
    ref_w, ref_ids = router_topk_reference(logits, 3)
    assert_bitwise_equal(w, ref_w, "reference path")
    assert torch.equal(ids, ref_ids)
    w0, ids0 = moefuse.router_topk(torch.empty(0, 12), 3, impl="triton")
    assert w0.shape == (0, 3) and ids0.shape == (0, 3)


def test_bad_input_names_the_argument_and_writes_nothing():
    logits = torch.randn(4, 8).to(torch.bfloat16)
    w = torch.zeros(4, 2)
    ids = torch.zeros(4, 2, dtype=torch.int32)
    call = moefuse.router_topk
    expect_value_error(lambda: call(logits.long(), 2), "router_logits")
    expect_value_error(lambda: call(logits[0], 2), "router_logits")
    for k in (0, 9, True, 2.0):
        expect_value_error(lambda k=k: call(logits, k, weights_out=w), "top_k", w)
    expect_value_error(lambda: call(logits, 2, scoring="relu", weights_out=w), "scoring", w)
    expect_value_error(lambda: call(logits, 2, renormalize=1, weights_out=w), "renormalize", w)
    expect_value_error(lambda: call(logits, 2, weights_dtype=torch.int32), "weights_dtype")
    expect_value_error(lambda: call(logits, 2, ids_dtype=torch.float32), "ids_dtype")
    expect_value_error(lambda: call(logits, 2, weights_out=w, ids_out=ids[:3]), "ids_out", w)
    expect_value_error(
        lambda: call(logits, 2, weights_out=w.bfloat16(), ids_out=ids), "weights_out", ids
    )
    expect_value_error(lambda: call(logits, 2, ids_out=ids, ids_dtype=torch.int64), "ids_out")
    buf = torch.zeros(4, 8)
    expect_value_error(
        lambda: call(buf, 2, weights_out=buf[:, :2], ids_out=ids), "weights_out", ids
    )
    assert not moefuse.supports_router_topk(logits, 9)
    reason = kernel_device_reason(logits.device)
    assert moefuse.supports_router_topk(logits, 2) == (reason is None)
