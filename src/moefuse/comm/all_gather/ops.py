"""torch.library custom ops of the all-gather + norm fusions, and the per-workspace state.

Each op writes caller-allocated outputs and returns nothing; ``mutates_args`` names exactly the
outputs. The workspace travels as its integer id. ``backend`` ("triton" | "reference") and
``algorithm`` ("auto" | "oneshot" | "torch") are decided by :mod:`moefuse.comm.all_gather.api`;
both backends run inside the op, so torch.compile sees one opaque collective either way.

The Triton backend is two launches on the stream: the column all-gather into this rank's
``gathered`` buffer (:func:`moefuse.comm.all_gather.kernels.launch_allgather`, Lamport over the
workspace's ``"allgather"`` region; or NCCL/gloo for ``algorithm="torch"``), then the
single-GPU op's own launcher on the gathered rows. With PDL the norm kernel is scheduled while
the all-gather waits on NVLink and loads its parameters before its grid-dependency wait.
Every op runs one kernel instead where its single-GPU tile allows
(:func:`moefuse.comm.all_gather.persistent.run_one_launch`): the decode kernel at M <= 64
(:mod:`moefuse.comm.all_gather.decode`) and the persistent gather + norm kernel above
(:mod:`moefuse.comm.all_gather.persistent`; ``MOEFUSE_ALLGATHER_LARGE=chunked`` keeps two launches,
``MOEFUSE_ALLGATHER_ONE_LAUNCH=0`` two launches at decode sizes).
"""

from __future__ import annotations

import weakref

import torch

from moefuse import knobs
from moefuse._dispatch import custom_op
from moefuse.comm.all_gather import reference as ref
from moefuse.comm.workspace import get_workspace

Tensor = torch.Tensor
ALGORITHMS = ("auto", "oneshot", "torch")
REGION = "allgather"
#: Lamport generations of the region (see moefuse.comm.all_gather.kernels)
GENERATIONS = 3


def allgather_regions(max_tokens: int, hidden_size: int) -> dict[str, int]:
    """``extra_regions`` entry of an :class:`AllReduceWorkspace` that the all-gather fusions
    use: three generations of ``[max_tokens, hidden_size]`` 16-bit slots (zero-filled = empty).
    Pass the workspace's own ``max_tokens`` and ``hidden_size``."""
    return {REGION: GENERATIONS * int(max_tokens) * int(hidden_size) * 2}


class AllGatherState:
    """Local (not peer-visible) state of the all-gather fusions on one workspace: the int32
    control words advanced by the kernel (generation, CTA arrivals) and, per 16-bit dtype, the
    ``[max_tokens, H]`` buffer the rows are gathered into. Created outside CUDA-graph capture
    (first eager call, or :func:`prepare_allgather`); a graph replays with the same buffers."""

    def __init__(self, ws):
        from moefuse.comm.all_gather.kernels import AG_CTRL_WORDS

        self.agctrl = torch.zeros(AG_CTRL_WORDS, dtype=torch.int32, device=ws.device)
        self.buffers: dict[torch.dtype, Tensor] = {}
        self._ws = weakref.ref(ws)

    def tensors(self) -> list[Tensor]:
        """What the kernels get (fixed addresses: launch plans may hold them)."""
        return [self.agctrl, *self.buffers.values()]

    def gathered(self, dtype: torch.dtype, m: int) -> Tensor:
        buf = self.buffers.get(dtype)
        if buf is None:
            _refuse_in_capture("allocate the gathered-rows buffer")
            ws = self._ws()
            buf = torch.empty((ws.max_tokens, ws.hidden_size), dtype=dtype, device=ws.device)
            self.buffers[dtype] = buf
        return buf[:m]


def _refuse_in_capture(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"moefuse.comm all-gather: cannot {what} during CUDA-graph capture; "
            "run the op once eagerly first (warm-up), or call "
            "moefuse.comm.prepare_allgather(workspace, dtype)"
        )


def region_reason(ws) -> str | None:
    """Why ``ws`` cannot carry the Lamport all-gather (None if it can)."""
    if REGION not in ws.regions:
        return (
            "the workspace has no 'allgather' region: create it with "
            "extra_regions=moefuse.comm.allgather_regions(max_tokens, hidden_size)"
        )
    need = allgather_regions(ws.max_tokens, ws.hidden_size)[REGION]
    if ws.regions[REGION][1] < need:
        return f"the workspace's 'allgather' region holds {ws.regions[REGION][1]} bytes < {need}"
    return None


def _new_state(ws) -> AllGatherState:
    _refuse_in_capture("create the all-gather state")
    return AllGatherState(ws)


def allgather_state(ws) -> AllGatherState:
    return ws.attachment("allgather", _new_state)


def prepare_allgather(ws, dtype: torch.dtype = torch.bfloat16) -> None:
    """Allocate the all-gather state of ``ws`` for shards of ``dtype`` now (outside capture)."""
    allgather_state(ws).gathered(dtype, 0)


def choose_algorithm(ws, m: int, algorithm: str) -> str:
    """ "oneshot" (peer buffers, M <= max_tokens) or "torch"; an explicit "oneshot" that cannot
    run raises. The same answer on every rank for the same M."""
    if algorithm == "torch":
        return "torch"
    reason = None
    if not ws.peer_access:
        reason = "the workspace has no peer buffers (peer_access is False)"
    elif m > ws.max_tokens:
        reason = f"{m} tokens > workspace max_tokens {ws.max_tokens}"
    else:
        reason = region_reason(ws)
    if reason is None:
        return "oneshot"
    if algorithm == "oneshot":
        raise RuntimeError(f"moefuse.comm all-gather: algorithm='oneshot' cannot run: {reason}")
    return "torch"


def chunk_rows(m: int, row_multiple: int = 1) -> int:
    """Rows per pipeline chunk for M tokens (M = no pipelining; see :func:`_execute`).

    MOEFUSE_ALLGATHER_CHUNK_ROWS overrides (0 = off; the same on every rank). Default: from
    :data:`CHUNK_MIN_TOKENS` tokens, :data:`CHUNKS` chunks of a multiple of 128 rows. FIRST
    GUESS, not measured: the bench times it against MOEFUSE_ALLGATHER_CHUNK_ROWS=0."""
    env = knobs.get("MOEFUSE_ALLGATHER_CHUNK_ROWS")
    if env is not None:
        rows = env or m
    elif m >= CHUNK_MIN_TOKENS:
        rows = -(-m // CHUNKS)
        rows = -(-rows // 128) * 128
    else:
        rows = m
    rows = -(-max(1, rows) // row_multiple) * row_multiple
    return min(m, rows)


#: token count from which the fused ops pipeline the all-gather with the norm (two streams)
CHUNK_MIN_TOKENS = 2048
CHUNKS = 4
_COMM_STREAMS: dict[int, torch.cuda.Stream] = {}


def _comm_stream(device: torch.device):
    """High-priority stream of the pipelined all-gather launches (one per device): the block
    scheduler then dispatches the gather CTAs of chunk c+1 ahead of the norm CTAs of chunk c,
    which would otherwise fill the SMs and leave the NVLink transfer waiting for a slot."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _COMM_STREAMS.get(index)
    if stream is None:
        _refuse_in_capture("create the communication stream")
        stream = _COMM_STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return stream


def _execute(
    ws_id: int,
    shard: Tensor,
    algorithm: str,
    backend: str,
    use_pdl: bool,
    run_rows,
    reference,
    row_multiple: int = 1,
    epilogue=None,
) -> None:
    """Gather, then the single-GPU op.

    ``run_rows(x, a, b, pdl)`` launches the single-GPU kernel on the gathered rows ``x`` (rows
    ``a:b`` of the token range) writing rows ``a:b`` of the outputs; ``reference(x)`` writes every
    output from the full gathered rows (reference backend).

    One-shot with M >= the chunk size (:func:`chunk_rows`): the all-gathers of the chunks run
    one after another on a high-priority communication stream (which first waits for the
    caller's stream: the shards), and the caller's stream runs chunk c's norm as soon as chunk
    c is gathered (event), so the norm of chunk c overlaps the NVLink transfer of chunk c+1.
    Every output is complete, in the caller's stream order, when the op returns; a later call's
    gathers wait for this call's norms (the communication stream waits for the caller's stream
    at entry), and all gather launches stay ordered (generations).
    The ops are batch-invariant, so per-chunk launches give the same bits as one launch.
    ``epilogue(dec)``, when given, describes the op as a
    :class:`moefuse.comm.all_gather.decode.Epilogue` (``dec`` is that module), so that gather +
    op may run as one kernel (:func:`_run_one_launch`)."""
    ws = get_workspace(ws_id)
    ws.raise_if_unusable()
    m = shard.shape[0]
    if backend == "reference":
        reference(ref.gather_columns(shard, ws))
        return
    if choose_algorithm(ws, m, algorithm) == "torch":
        run_rows(ref.gather_columns(shard, ws), 0, m, use_pdl)
        return
    from moefuse.comm.all_gather.kernels import launch_allgather

    state = allgather_state(ws)
    gathered = state.gathered(shard.dtype, m)
    step = chunk_rows(m, row_multiple)
    if epilogue is not None and _run_one_launch(
        ws, state, shard, gathered, epilogue, use_pdl, step >= m
    ):
        pass
    elif step >= m:
        launch_allgather(ws, state, shard, gathered, use_pdl)
        run_rows(gathered, 0, m, use_pdl)
    elif shard.device.type != "cuda":  # interpreter: the same chunks, one after another
        for a in range(0, m, step):
            b = min(m, a + step)
            launch_allgather(ws, state, shard[a:b], gathered[a:b], False)
            run_rows(gathered[a:b], a, b, False)
    else:
        main = torch.cuda.current_stream(shard.device)
        comm = _comm_stream(shard.device)
        comm.wait_stream(main)
        for a in range(0, m, step):
            b = min(m, a + step)
            with torch.cuda.stream(comm):
                launch_allgather(ws, state, shard[a:b], gathered[a:b], False)
            ready = torch.cuda.Event()
            ready.record(comm)
            main.wait_event(ready)
            run_rows(gathered[a:b], a, b, False)  # (full event dependency: no PDL edge)
    if ws.check_each_call:
        ws.poll_status()


def _run_one_launch(
    ws, state, shard: Tensor, gathered: Tensor, epilogue, use_pdl: bool, unchunked: bool
) -> bool:
    """Gather + the op of ``epilogue`` as one kernel where one can run it
    (:func:`moefuse.comm.all_gather.persistent.run_one_launch`; False: the caller runs two
    launches).
    ``unchunked``: the two-launch path would run one chunk."""
    from moefuse.comm.all_gather import decode as dec
    from moefuse.comm.all_gather import persistent as fused

    return fused.run_one_launch(ws, state, shard, gathered, epilogue(dec), use_pdl, unchunked)


# ----------------------------------------------------------------------------- ops
@custom_op("moefuse::all_gather_rmsnorm", mutates_args=("out",))
def all_gather_rmsnorm_op(
    shard: Tensor,
    weight: Tensor,
    out: Tensor,
    workspace_id: int,
    eps: float,
    gain_center: float,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    from moefuse.norm.rms import launch_rmsnorm

    def run_rows(x, a, b, pdl):
        launch_rmsnorm(x, weight, out[a:b], eps, gain_center, pdl)

    def reference(x):
        out.copy_(ref.norm_ref.rmsnorm_reference(x, weight, eps, gain_center))

    def epilogue(dec):
        return dec.Epilogue(dec.RMSNORM, weight, out, eps, gain_center)

    _execute(
        workspace_id, shard, algorithm, backend, use_pdl, run_rows, reference, epilogue=epilogue
    )


@all_gather_rmsnorm_op.register_fake
def _(shard, weight, out, workspace_id, eps, gain_center, algorithm, use_pdl, backend):
    return None


@custom_op("moefuse::all_gather_rmsnorm_fp8", mutates_args=("out",))
def all_gather_rmsnorm_fp8_op(
    shard: Tensor,
    weight: Tensor,
    scale: Tensor,
    out: Tensor,
    fmt: int,
    workspace_id: int,
    eps: float,
    gain_center: float,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    """``out``: the FP8 bytes (uint8) of format ``fmt`` (moefuse.quant.formats.FP8_CODE)."""
    from moefuse.quant import formats as F
    from moefuse.quant.fused import launch_rmsnorm_fp8

    def run_rows(x, a, b, pdl):
        launch_rmsnorm_fp8(x, None, weight, scale, out[a:b], fmt, eps, gain_center, pdl)

    def reference(x):
        dtype = next(d for d, c in F.FP8_CODE.items() if c == fmt)
        q = ref.quant_ref.rmsnorm_quant_reference(x, weight, scale, eps, dtype, gain_center)
        out.copy_(q.view(torch.uint8))

    def epilogue(dec):
        return dec.Epilogue(dec.FP8, weight, out, eps, gain_center, aux=scale, fmt=fmt)

    _execute(
        workspace_id, shard, algorithm, backend, use_pdl, run_rows, reference, epilogue=epilogue
    )


@all_gather_rmsnorm_fp8_op.register_fake
def _(shard, weight, scale, out, fmt, workspace_id, eps, gain_center, algorithm, use_pdl, backend):
    return None


#: rows of one scale tile per NVFP4 layout: pipeline chunks start on a tile boundary
_SCALE_ROW_TILE = {"swizzled_128x4": 128, "swizzled_8x4": 8, "linear": 1}


@custom_op("moefuse::all_gather_rmsnorm_fp4_quantize", mutates_args=("packed", "scales"))
def all_gather_rmsnorm_fp4_quantize_op(
    shard: Tensor,
    weight: Tensor,
    global_scale: Tensor,
    packed: Tensor,
    scales: Tensor,
    workspace_id: int,
    eps: float,
    gain_center: float,
    layout: str,
    recipe: str,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    from moefuse.quant.fused import launch_rmsnorm_fp4

    tile = _SCALE_ROW_TILE[layout]

    def run_rows(x, a, b, pdl):
        # rows a:b (a on a tile boundary) own scale rows a : a + round_up(b - a, tile) of the
        # padded [Mp, Kp] matrix: the last chunk also writes the padding rows (zeros)
        sf = scales[a : a + -(-(b - a) // tile) * tile]
        launch_rmsnorm_fp4(
            x,
            None,
            weight,
            global_scale,
            packed[a:b],
            sf,
            None,
            eps,
            gain_center,
            layout,
            recipe,
            pdl,
        )

    def reference(x):
        p, sf, _ = ref.quant_ref.rmsnorm_fp4_quantize_reference(
            x, weight, global_scale, eps, layout, recipe, gain_center
        )
        packed.copy_(p)
        scales.copy_(sf.reshape(scales.shape))

    def epilogue(dec):
        return dec.Epilogue(
            dec.FP4,
            weight,
            packed,
            eps,
            gain_center,
            aux=global_scale,
            scales=scales,
            layout=layout,
            recipe=recipe,
        )

    _execute(workspace_id, shard, algorithm, backend, use_pdl, run_rows, reference, tile, epilogue)


@all_gather_rmsnorm_fp4_quantize_op.register_fake
def _(
    shard,
    weight,
    global_scale,
    packed,
    scales,
    workspace_id,
    eps,
    gain_center,
    layout,
    recipe,
    algorithm,
    use_pdl,
    backend,
):
    return None


@custom_op(
    "moefuse::all_gather_gated_residual_next_rmsnorm",
    mutates_args=("residual_out", "ffn_input", "router_input"),
)
def all_gather_gated_residual_next_rmsnorm_op(
    branch_shard: Tensor,
    residual: Tensor,
    next_weight: Tensor,
    alpha: Tensor | None,
    alpha_scalar: float,
    beta: Tensor,
    post_weight: Tensor | None,
    residual_out: Tensor,
    ffn_input: Tensor,
    router_input: Tensor | None,
    workspace_id: int,
    post_eps: float,
    next_eps: float,
    next_gain_center: float,
    post_gain_center: float,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    from moefuse.norm.gated import launch_gated_residual_next_rmsnorm

    def run_rows(x, a, b, pdl):
        router = router_input[a:b] if router_input is not None else None
        launch_gated_residual_next_rmsnorm(
            x,
            residual[a:b],
            next_weight,
            alpha,
            alpha_scalar,
            beta,
            post_weight,
            residual_out[a:b],
            ffn_input[a:b],
            router,
            post_eps,
            next_eps,
            next_gain_center,
            post_gain_center,
            pdl,
        )

    def reference(x):
        a = alpha if alpha is not None else alpha_scalar
        ro, ffn, router = ref.norm_ref.gated_residual_next_rmsnorm_reference(
            x,
            residual,
            next_weight,
            a,
            beta,
            post_eps,
            next_eps,
            next_gain_center,
            post_weight,
            post_gain_center,
        )
        # residual_out may be residual (in place): everything is computed before it is written
        residual_out.copy_(ro)
        ffn_input.copy_(ffn)
        if router_input is not None:
            router_input.copy_(router)

    def epilogue(dec):
        g = dec.GatedArgs(
            residual,
            alpha,
            alpha_scalar,
            beta,
            post_weight,
            residual_out,
            router_input,
            post_eps,
            post_gain_center,
        )
        return dec.Epilogue(dec.GATED, next_weight, ffn_input, next_eps, next_gain_center, gated=g)

    _execute(
        workspace_id,
        branch_shard,
        algorithm,
        backend,
        use_pdl,
        run_rows,
        reference,
        epilogue=epilogue,
    )


@all_gather_gated_residual_next_rmsnorm_op.register_fake
def _(
    branch_shard,
    residual,
    next_weight,
    alpha,
    alpha_scalar,
    beta,
    post_weight,
    residual_out,
    ffn_input,
    router_input,
    workspace_id,
    post_eps,
    next_eps,
    next_gain_center,
    post_gain_center,
    algorithm,
    use_pdl,
    backend,
):
    return None
