"""Self-attention from the hidden states: the QKV projection, then JFA over its packed output.

:func:`qkv_attention` is ``jagged_attention_packed(linear(x, weight, bias).view(T, 3, H, D), ...)``, with the bias's
gradient (dqkv's column sums) written by JFA's bf16 backward kernels instead of a pass over dqkv. With
``precision="fp8", fuse_projection=True`` on the Triton path the projection and FP8 attention's quantization are
one kernel (:mod:`opengem.ops.triton.qkv_projection_fp8`): Q, K and V are quantized in the GEMM's epilogue
instead of being read back by the quantize pass (issue 12). It is off by default: on an H200 at model dim 512
(H 4, D 128, 150k tokens) it took 0.956 ms against 0.437 ms for cuBLAS's projection plus 0.341 ms for the
quantize pass, in one run (``benchmarks/RESULTS.md``, session 17, call 6): with K 512 each 128 x 128 tile's epilogue (bf16 store,
Hadamard rotation, quantization) outlasts its main loop, one program an SM. The backward is the FP8 op's (JFA's
bf16 kernels straight through the quantization, into one packed ``dqkv``), then the projection's two GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from opengem.ops.autocast import cast_inputs
from opengem.ops.jagged_attention import (
    _jagged_attention_packed_bwd,
    _op_options,
    _problem,
    _use_triton,
    forward_flops,
    jagged_attention_packed,
)


@torch.library.custom_op("opengem::qkv_attention_fp8_fwd", mutates_args=())
def _qkv_attention_fp8_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    heads: int,
    offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    max_len: int,
    causal: bool,
    contextual_len: int,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [T, H, D], lse [H, T], qkv [T, 3, H, D])``: the fused projection + FP8 attention (Triton only)."""
    from opengem.ops.triton.qkv_projection_fp8 import projected_attention_forward

    _, pb = _problem(x, offsets, num_targets, max_len, causal, contextual_len, window, scale)
    return projected_attention_forward(x, weight, bias, heads, pb)


@_qkv_attention_fp8_fwd.register_fake
def _(x, weight, bias, heads, offsets, num_targets, max_len, causal, contextual_len, window, scale):
    total, head_dim = x.shape[0], weight.shape[0] // (3 * heads)
    return (
        x.new_empty((total, heads, head_dim)),
        x.new_empty((heads, total), dtype=torch.float32),
        x.new_empty((total, 3, heads, head_dim)),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, _, offsets, num_targets, max_len, causal, contextual_len, window, scale = inputs
    out, lse, qkv = output
    ctx.save_for_backward(x, weight, qkv, out, lse, offsets, num_targets)
    ctx.set_materialize_grads(False)  # lse and qkv get no gradient unless used: None, not zeros
    ctx.has_bias = bias is not None
    ctx.options = (max_len, causal, contextual_len, window, scale)


def _backward(ctx, dout, dlse, dqkv_out):
    x, weight, qkv, out, lse, offsets, num_targets = ctx.saved_tensors
    dqkv, _ = _jagged_attention_packed_bwd(dout, qkv, out, lse, offsets, num_targets, *ctx.options, True, "fp8")
    if dqkv_out is not None:  # qkv is an output too (saved for the backward); a user of it adds its gradient
        dqkv = dqkv + dqkv_out
    flat = dqkv.flatten(1)  # [T, 3 H D]
    dx, dweight = flat @ weight, flat.t() @ x
    dbias = flat.sum(0) if ctx.has_bias else None
    return dx, dweight, dbias, None, None, None, None, None, None, None, None


_qkv_attention_fp8_fwd.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.opengem.qkv_attention_fp8_fwd, get_raw=True)
def _fwd_flops(x, weight, bias, heads, offsets, num_targets, max_len, causal, contextual_len, window, scale,
               out_val=None):  # fmt: skip
    """The projection's GEMM (2 T d 3HD) and the attention's 4 H D per unmasked pair."""
    head_dim = weight.shape[0] // (3 * heads)
    projection = 2 * x.shape[0] * x.shape[1] * weight.shape[0]
    return projection + forward_flops(heads, head_dim, offsets, num_targets, causal, contextual_len, window,
                                     x.shape[0], max_len)


def qkv_attention(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor,
    max_len: int,
    *,
    num_heads: int,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    scale: float | None = None,
    backend: str | None = None,
    precision: str = "bf16",
    fuse_projection: bool = False,
) -> torch.Tensor:
    """``jagged_attention_packed(F.linear(x, weight, bias).view(T, 3, num_heads, D), ...)``: ``x [T, d]``,
    ``weight [3 num_heads D, d]`` (Q's rows, then K's, then V's), ``bias [3 num_heads D]`` or None; the mask
    and precision arguments as :func:`~opengem.ops.jagged_attention.jagged_attention`'s. Returns ``[T, H, D]``.
    ``fuse_projection=True`` (``precision="fp8"`` only) quantizes in the projection's epilogue on the Triton path,
    the same FP8 blocks as the quantize pass (module docstring for when it pays)."""
    if fuse_projection and precision != "fp8":
        raise ValueError(f"fuse_projection fuses FP8 attention's quantization: it needs precision='fp8', got "
                         f"{precision!r}")  # fmt: skip
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] % (3 * num_heads):
        raise ValueError(f"x [T, d] and weight [3 * num_heads * D, d] expected with num_heads = {num_heads}, got x "
                         f"{list(x.shape)} and weight {list(weight.shape)}")  # fmt: skip
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape [{weight.shape[0]}], got {list(bias.shape)}")
    head_dim = weight.shape[0] // (3 * num_heads)
    tensors = (x, weight) if bias is None else (x, weight, bias)
    (x, weight, *rest), autocast_off = cast_inputs(*tensors)
    bias = rest[0] if rest else None
    if fuse_projection and _use_triton(x, backend):
        shaped = x.new_empty(()).expand(x.shape[0], num_heads, head_dim)  # what the checks see: q, k and v's shape
        options = _op_options(shaped, shaped, shaped, offsets, max_len, causal, num_targets, contextual_len, window,
                              scale, False, backend, precision, "bf16", fn="qkv_attention")  # fmt: skip
        with autocast_off:  # the fused op takes the options up to the scale (use_triton and precision are set)
            out, _, _ = _qkv_attention_fp8_fwd(x, weight, bias, num_heads, *options[:7])
        return out
    with autocast_off:
        # The bias's gradient is dqkv's column sums: the packed op takes the bias and returns them from its backward
        # kernels' fp32 tiles (bf16 Triton path), so the projection adds it without a gradient of its own; a pass
        # over dqkv [T, 3 H D] less (gem-large: 0.8 GB a layer, 2.5 ms a step on an H200, session 31).
        qkv = F.linear(x, weight, None if bias is None else bias.detach()).view(x.shape[0], 3, num_heads, head_dim)
        return jagged_attention_packed(qkv, offsets, max_len, causal=causal, num_targets=num_targets,
                                       contextual_len=contextual_len, window=window, scale=scale, backend=backend,
                                       precision=precision, projection_bias=bias)  # fmt: skip
