"""The fused router top-k on the GPU: against the torch reference at model shapes (Qwen3-MoE 128 x
8, Mixtral 8 x 2, DeepSeek-V3-sized 256 x 8, odd 60 x 4), outputs poisoned first; a row's bits
alone or in any batch; bits under CUDA-graph replay and from run to run; a compiled call."""

import pytest
import torch

import moefuse
from moefuse.moe.reference import router_topk_reference
from moefuse.testing import assert_bitwise_equal, capture_graph, poison_

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("e,k", [(128, 8), (8, 2), (256, 8), (60, 4)])
@pytest.mark.parametrize("m", [1, 7, 64, 2048, 4097])
def test_matches_reference_and_is_row_invariant(e, k, m):
    g = torch.Generator(device="cuda").manual_seed(e * 31 + m)
    logits = (torch.randn(m, e, generator=g, device="cuda") * 2).to(torch.bfloat16)
    w = poison_(torch.empty(m, k, dtype=torch.bfloat16, device="cuda"))
    ids = poison_(torch.empty(m, k, dtype=torch.int64, device="cuda"))
    kw = dict(weights_dtype=torch.bfloat16, ids_dtype=torch.int64)
    moefuse.router_topk(logits, k, weights_out=w, ids_out=ids, **kw)
    ref_w, ref_ids = router_topk_reference(logits, k, "softmax", True, torch.bfloat16, torch.int64)
    # the device's exp moves scores by a few FP32 ulps: ids may differ only where the reference's
    # chosen scores are that close to an unchosen one
    scores = torch.softmax(logits.float(), -1)
    differ = (ids != ref_ids).any(1)
    if differ.any():
        got_s = scores.gather(1, ids[differ]).sort(-1).values
        ref_s = scores.gather(1, ref_ids[differ]).sort(-1).values
        torch.testing.assert_close(got_s, ref_s, rtol=1e-5, atol=0)
    assert differ.float().mean() < 0.01
    torch.testing.assert_close(w[~differ].float(), ref_w[~differ].float(), rtol=8e-3, atol=0)
    for rows in (slice(0, 1), slice(m // 2, m // 2 + 1), slice(m - 1, m)):
        part_w, part_ids = moefuse.router_topk(logits[rows].contiguous(), k, **kw)
        assert_bitwise_equal(part_w, w[rows], f"row {rows}")
        assert torch.equal(part_ids, ids[rows])


def test_graph_replay_and_compile_give_the_eager_bits():
    g = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(300, 128, generator=g, device="cuda").to(torch.bfloat16)
    kw = dict(weights_dtype=torch.bfloat16, ids_dtype=torch.int64)
    w, ids = moefuse.router_topk(logits, 8, **kw)
    w2, ids2 = moefuse.router_topk(logits, 8, **kw)
    assert_bitwise_equal(w2, w, "run to run")
    wg = poison_(torch.empty_like(w))
    ig = poison_(torch.empty_like(ids))
    graph = capture_graph(lambda: moefuse.router_topk(logits, 8, weights_out=wg, ids_out=ig, **kw))
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(wg, w, "graph replay")
    assert torch.equal(ig, ids)
    compiled = torch.compile(lambda x: moefuse.router_topk(x, 8, **kw), fullgraph=True)
    cw, cids = compiled(logits)
    assert_bitwise_equal(cw, w, "compiled")
    assert torch.equal(cids, ids)
