"""The QKV projection with FP8 attention's quantization in its epilogue (issue 12: quantization fused into the
producer, instead of a pass that reads Q, K and V back).

One program per (sample-aligned block of ``BLOCK`` rows, operand head): the ``[BLOCK, D]`` tile of
``x W^T + b`` for that head of Q, K or V, with the rows of one block of :mod:`opengem.ops.triton.jagged_attention_fp8`'s
blocked layout. The tile is stored in the input dtype into ``qkv [T, 3, H, D]`` (the backward's saved
activations) and, from those same rounded values, rotated (Q, K) and quantized exactly as that module's quantize
pass does, so ``quantize_qkv(*qkv.unbind(1))`` would write the same blocks and scales. Programs of one block run
next to each other (operand heads fastest), so the block's ``x`` rows are read from HBM once and from L2 after.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from opengem.ops.reference.attention_fp8 import rotation_size
from opengem.ops.triton.jagged_attention import _INTERPRET, Problem, _sample, forward_buffers
from opengem.ops.triton.jagged_attention_fp8 import (
    BLOCK,
    _rotation_on,
    _store_quantized,
    attend,
    blocked_buffers,
    rotate_slices,
)
from opengem.ops.triton.tuning import autotune

# (BLOCK_K, num_warps, num_stages), the first the untuned default. One 128 x D fp32 tile a program: 144-164
# registers at 8 warps (one program an SM), 98 at 16, no spills at D 128 (static sm_90 counts, benchmarks/sass.py).
_TILES = [(64, 8, 3), (64, 16, 3), (32, 8, 4), (16, 8, 4)]
K_ALIGN = 16  # the smallest reduction step: model_dim must be a multiple of it


def _configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_K": K_ALIGN}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_K": k}, num_warps=w, num_stages=s) for k, w, s in _TILES]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Steps that divide model_dim (the loop is unmasked along it, so Triton pipelines its loads); two stages at
    D = 256 (shared memory), 16 warps first; OPENGEM_JFA_AUTOTUNE=0 keeps the first left."""
    model_dim = named_args["model_dim"]
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    kept = [c for c in configs if model_dim % c.kwargs["BLOCK_K"] == 0]
    if head_dim == 256 and not _INTERPRET:  # 16 warps first: a 128 x 256 fp32 tile spills at 8
        kept = [triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=min(c.num_stages, 2)) for c in kept]
        kept.sort(key=lambda c: -c.num_warps)
    return kept[:1] if os.environ.get("OPENGEM_JFA_AUTOTUNE") == "0" else kept


@autotune(configs=_configs(), key=["model_dim", "HEAD_DIM", "PRECISION"],
          prune_configs_by={"early_config_prune": _prune})  # fmt: skip
@triton.jit(do_not_specialize=["num_blocks"])
def _project_quantize_kernel(
    X, W, Bias, QKV, Q8, K8, V8, QS, KS, VS, R, offsets, block_base, items,
    stride_xt, stride_wn, num_blocks, heads, model_dim,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROT: tl.constexpr, PRECISION: tl.constexpr, EXACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One tile a program: one (block, operand head), operand heads fastest."""
    operands = 3 * heads
    item = tl.program_id(0) // operands
    operand = tl.program_id(0) % operands  # q heads, then k heads, then v heads: W's rows operand * D + [0, D)
    b = tl.load(items + 2 * item)
    row = tl.load(items + 2 * item + 1)
    start, seq_len, _ = _sample(offsets, offsets, b, False)
    block_id = tl.load(block_base + b) + row // BLOCK
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_k = tl.arange(0, BLOCK_K)
    ok = (row + offs_r) < seq_len
    x_rows = X + (start + row + offs_r).to(tl.int64)[:, None] * stride_xt
    w_cols = W + (operand * HEAD_DIM + offs_d)[None, :] * stride_wn
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    for k0 in tl.range(0, model_dim, BLOCK_K):  # BLOCK_K divides model_dim (the configs' pruning keeps such)
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=ok[:, None], other=0.0)
        w = tl.load(w_cols + (k0 + offs_k)[:, None])  # W^T's [BLOCK_K, D] tile
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + operand * HEAD_DIM + offs_d).to(tl.float32)[None, :]
    y = acc.to(QKV.dtype.element_ty)
    qkv_rows = QKV + (start + row + offs_r).to(tl.int64)[:, None] * (operands * HEAD_DIM)
    tl.store(qkv_rows + operand * HEAD_DIM + offs_d[None, :], y, mask=ok[:, None])
    y = tl.where(ok[:, None], y, 0.0)  # rows past the sample quantize as zeros, as the quantize pass loads them
    h = operand % heads
    if operand < heads:
        q = rotate_slices(y, R, BLOCK, HEAD_DIM, ROT, PRECISION).to(tl.float32)
        _store_quantized(q, Q8, QS, h, block_id, num_blocks, HEAD_DIM, BLOCK, False, EXACT)
    elif operand < 2 * heads:
        k = rotate_slices(y, R, BLOCK, HEAD_DIM, ROT, PRECISION).to(tl.float32)
        _store_quantized(k, K8, KS, h, block_id, num_blocks, HEAD_DIM, BLOCK, False, EXACT)
    else:
        _store_quantized(y.to(tl.float32), V8, VS, h, block_id, num_blocks, HEAD_DIM, BLOCK, True, EXACT)


def project_quantize_qkv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: int, pb: Problem
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``qkv = (x @ weight.T + bias).view(T, 3, heads, D)`` in x's dtype, and its FP8 blocks as
    :func:`~opengem.ops.triton.jagged_attention_fp8.quantize_qkv` returns them. ``x [T, d]`` (unit column
    stride), ``weight [3 heads D, d]``, ``bias [3 heads D]`` or None, all one dtype. One program a tile."""
    total, model_dim = x.shape
    head_dim = weight.shape[0] // (3 * heads)
    if model_dim % K_ALIGN:
        raise ValueError(f"the fused FP8 QKV projection needs the model dim a multiple of {K_ALIGN}, got {model_dim}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    qkv = torch.empty((total, 3, heads, head_dim), dtype=x.dtype, device=x.device)
    items = pb.sched.query_tiles[BLOCK]  # one item per block
    quantized = blocked_buffers(pb, heads, heads, head_dim, x.device)
    q8, k8, v8, qs, ks, vs, block_base = quantized
    num_tiles = items.shape[0] * 3 * heads
    if num_tiles:
        n = rotation_size(head_dim)
        _project_quantize_kernel[(num_tiles,)](
            x, weight, weight if bias is None else bias, qkv, q8, k8, v8, qs, ks, vs,
            _rotation_on(n, x.dtype, x.device), pb.offsets, block_base, items, x.stride(0), weight.stride(0),
            items.shape[0], heads, model_dim,
            HEAD_DIM=head_dim, BLOCK=BLOCK, ROT=n, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            EXACT=_INTERPRET, HAS_BIAS=bias is not None,
        )  # fmt: skip
    return qkv, quantized


def projected_attention_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: int, pb: Problem
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 attention of the projection of ``x``: ``(out [T, H, D], lse [H, T], qkv [T, 3, H, D])``, qkv in x's
    dtype for the backward."""
    qkv, quantized = project_quantize_qkv(x, weight, bias, heads, pb)
    _, out, lse, has_work = forward_buffers(*qkv.unbind(1), pb)
    if has_work:
        attend(quantized, out, lse, heads, pb)
    return out, lse, qkv
