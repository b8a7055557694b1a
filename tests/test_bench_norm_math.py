"""The unfused PyTorch math the norm benchmark compiles as its baselines (CPU, no GPU): the
in-place variants (``compile_inplace``) must write exactly what the out-of-place ones return."""

import torch

from moefuse.bench import norm as bn


def test_inplace_baselines_write_what_the_out_of_place_math_returns(seed):
    x, r = (torch.randn(5, 96).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(96).to(torch.bfloat16)
    normed, res = bn.torch_fused_add_rmsnorm(x, r, w)
    xi, ri = x.clone(), r.clone()
    bn.INPLACE_MATH["fused_add_rmsnorm"](xi, ri, w)
    assert torch.equal(xi, normed) and torch.equal(ri, res)
    g = torch.randn(5, 4, 24).to(torch.bfloat16)
    x3 = torch.randn(5, 4, 24).to(torch.bfloat16)
    expected = bn.torch_rmsnorm_sigmoid_gate(x3, g)
    bn.INPLACE_MATH["rmsnorm_sigmoid_gate"](x3, g)
    assert torch.equal(x3, expected)
