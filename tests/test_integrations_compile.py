"""Patched transformers models under ``torch.compile(fullgraph=True)`` on CPU (Triton kernels in
the interpreter, ``impl="triton"``: the custom-op path a GPU traces; ``aot_eager`` backend, which
needs no C++ compiler). A graph break anywhere fails ``fullgraph=True``. Checks, per model: a
compiled prefill (the routing-plan experts path, the fused residual norms and their next-norm
hand-off, the shared-expert finalize of DeepSeek-V3) has the patched model's eager logits bit for
bit and its graph holds the moefuse ops; compiled with ``dynamic=True``, one graph serves two
prompt lengths with the eager bits, and ``torch.export`` with a dynamic length holds them too;
a static-cache ``generate`` whose decode steps run compiled (the slot-order experts path, one
token) gives the eager static-cache tokens, with no graph break counted by dynamo, and writes the
graph inputs the shipped model's decode step writes. The GPU file does the same with inductor
and CUDA graphs."""

from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install moefuse[transformers])"
)

from torch._dynamo.utils import counters  # noqa: E402

from moefuse.integrations import transformers as mt  # noqa: E402
from moefuse.testing import assert_bitwise_equal  # noqa: E402
from test_integrations_transformers import VOCAB, build  # noqa: E402

pytestmark = pytest.mark.interpreter
KINDS = ("qwen3_moe", "mixtral", "deepseek_v3")
GEN = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)


class GraphRecorder:
    """``backend``: a torch.compile backend (a plain function: transformers deep-copies its
    CompileConfig) running ``aot_eager`` and keeping the op names of every graph it gets and the
    shapes of the graph inputs each graph writes (aot_autograd's input metadata, in input
    order)."""

    def __init__(self):
        self.targets: list[set[str]] = []
        self.mutated: list[tuple] = []

        def fw(g, inputs):
            info = torch._guards.TracingContext.get().fw_metadata.input_info
            self.mutated.extend(
                tuple(inputs[i].shape) for i, x in enumerate(info) if x.mutates_data
            )
            return g

        def backend(gm, example_inputs):
            from torch._dynamo.backends.common import aot_autograd

            self.targets.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
            return aot_autograd(fw_compiler=fw)(gm, example_inputs)

        self.backend = backend

    def ops_seen(self) -> set[str]:
        """``moefuse.<name>.default`` targets -> names."""
        return {t.split(".")[1] for ts in self.targets for t in ts if t.startswith("moefuse.")}


def patched(kind: str):
    model = build(kind, 1).to(torch.bfloat16)
    report = mt.patch(model, impl="triton")
    assert report["fused_layers"] == 2, report
    return model


def _breaks() -> int:
    return sum(counters["graph_break"].values())


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_compiled_prefill_fullgraph_equals_eager(kind):
    model = patched(kind)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    eager = model(ids).logits
    counters.clear()
    rec = GraphRecorder()
    got = torch.compile(model, fullgraph=True, backend=rec.backend)(ids).logits
    assert _breaks() == 0, dict(counters["graph_break"])
    assert len(rec.targets) == 1, "one graph"
    seen = rec.ops_seen()
    assert {"rmsnorm", "fused_add_rmsnorm"} <= seen, seen
    # the experts: the fused op where the module's layout allows it, else the composed path
    assert "moe_experts" in seen or {"moe_finalize", "moe_permute"} <= seen, seen
    assert_bitwise_equal(got, eager, f"{kind}: compiled prefill")


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])  # Mixtral: Qwen3's path
@torch.inference_mode()
def test_compiled_dynamic_shapes_one_graph_for_every_length(kind):
    """``torch.compile(dynamic=True)``, as a serving engine compiles: the prompt length is
    symbolic, one graph serves lengths 4 and 24 without a recompile, each with the eager bits.
    At top-3 over 8 experts these are 12 and 72 routed slots: the fused experts' inline plan,
    then the plan kernel with a wider token tile (32 columns, not 16), which the launcher picks
    at run time, not at trace time."""
    model = patched(kind)
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for length in (4, 24):
        ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        assert_bitwise_equal(compiled(ids).logits, model(ids).logits, f"{kind}: length {length}")
    assert _breaks() == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


@torch.no_grad()
def test_export_with_a_symbolic_length():
    """``torch.export`` of a patched Qwen3-MoE with the prompt length declared dynamic over
    2-4,096: no guard of moefuse narrows the range, the program holds the moefuse ops and gives
    the eager bits at a length it was not traced at. (DeepSeek-V3's attention does not export
    in transformers itself.)"""
    kind = "qwen3_moe"
    model = patched(kind)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    length = torch.export.Dim("length", min=2, max=4096)
    program = torch.export.export(_Logits(model), (ids,), dynamic_shapes={"ids": {1: length}})
    ops = {str(n.target) for n in program.graph.nodes if str(n.target).startswith("moefuse.")}
    assert {"moefuse.moe_experts.default", "moefuse.fused_add_rmsnorm.default"} <= ops, ops
    other = torch.randint(0, VOCAB, (1, 23), generator=torch.Generator().manual_seed(23))
    want = model(other, use_cache=False).logits
    assert_bitwise_equal(program.module()(other), want, f"{kind}: exported program")


def _compiled_generate(model, prompt) -> tuple[torch.Tensor, GraphRecorder]:
    """Static-cache ``generate`` with its decode step compiled (``CompileConfig(fullgraph=True)``:
    a graph break is an error) by a fresh :class:`GraphRecorder`: the tokens and the recorder."""
    rec = GraphRecorder()
    config = tf.CompileConfig(fullgraph=True, backend=rec.backend, mode=None)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    torch._dynamo.reset()
    got = model.generate(prompt, cache_implementation="static", compile_config=config, **GEN)
    return got, rec


@pytest.mark.parametrize("kind", KINDS[:2])
@torch.no_grad()
def test_static_cache_generate_compiled_fullgraph(kind):
    """``generate(cache_implementation="static")`` compiles the decode step (prefill runs eager)
    and gives the eager static-cache tokens with no graph break.

    Qwen3-MoE: the patched decode step writes exactly the graph inputs the shipped one writes
    (the static cache and its position). CUDA-graph trees (``mode="reduce-overhead"``, what
    ``generate`` compiles with) run a graph without its CUDA graph when it writes an input not
    known as static, so the patch cannot cost the graph replay; the GPU test counts inductor's
    skips."""
    model = patched(kind)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    want = model.generate(prompt, cache_implementation="static", disable_compile=True, **GEN)
    counters.clear()
    got, rec = _compiled_generate(model, prompt)
    assert rec.targets, "generate did not compile the decode step"
    assert _breaks() == 0, dict(counters["graph_break"])
    # the decode step: the fused experts op (or slot-order experts: no permute), fused norms
    # with the next-norm hand-off
    seen = rec.ops_seen()
    assert {"rmsnorm", "fused_add_rmsnorm"} <= seen and seen & {"moe_experts", "moe_finalize"}, seen
    assert "moe_permute" not in seen
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    if kind == "qwen3_moe":
        _, shipped = _compiled_generate(build(kind, 1).to(torch.bfloat16), prompt)
        assert shipped.mutated and rec.mutated == shipped.mutated, (rec.mutated, shipped.mutated)


def test_compiled_generate_bench_times_a_reused_cache_too(tmp_path):
    """``bench hf_moe --compiled``'s generate stage (tiny shapes, aot_eager): besides
    transformers' default (a new static cache per call), a row that resets and reuses one static
    cache across calls (its tensors keep their addresses, so CUDA-graph trees replay instead of
    recording again), with the same greedy tokens; one pass over both variants (each pass
    compiles every variant twice, a new and a reused cache; the merge of several passes into one
    row: tests/test_bench_hf_moe.py)."""
    from moefuse.bench import hf_moe

    argv = ["--smoke", "--compiled", "--skip", "step", "profile", "fp32", "prefill"]
    argv += ["--generate-passes", "1", "--repeats", "1", "--new", "4", "--out", str(tmp_path)]
    result = hf_moe.main(argv)
    rows = result["rows"]
    # skipped stages: their bars say so; the generate bars are read (CPU timings: any verdict)
    assert [line.split(":")[0] for line in result["bars"][:2]] == ["BAR MISSING"] * 2
    assert all(line.startswith(("BAR PASS", "BAR FAIL")) for line in result["bars"][2:])
    for variant in ("shipped", "patched"):
        by_op = {r["op"]: r for r in rows if r.get("variant") == variant}
        reused = by_op["compiled generate, one reused cache"]
        assert reused["same_tokens_as_new_cache"] and "tok_s" in reused  # (timed; any value)
        assert by_op["compiled generate"]["graph_breaks"] == 0
        assert "cudagraph_skips" in by_op["compiled generate"]  # counted on GPUs (inductor)
        for row in by_op.values():  # one row per variant and op, through merge_passes
            assert len(row["tok_s_passes"]) == 1, row
