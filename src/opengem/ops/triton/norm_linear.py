"""Triton kernels of ``opengem.ops.norm_linear``: a LayerNorm folded into the GEMM it feeds, for rows of up to 512.

Forward: one program owns ``BLOCK_M`` whole rows of ``x``. It reads them once, normalizes them in fp32 (the row
statistics are saved for the backward), casts them to the weight's dtype and keeps them on chip while it walks
over the output columns ``BLOCK_N`` at a time; the weight comes from L2. The normalized rows never reach HBM
(a LayerNorm then a GEMM writes and reads them back: 2 bytes an element each way in bf16).

Backward: one program owns ``BLOCK_M`` rows of ``dx``. It accumulates ``dy @ W`` (the normalized rows' gradient)
over the output columns into a ``[BLOCK_M, K]`` fp32 tile and runs the LayerNorm backward on it in the epilogue,
adding the pass-through gradient of ``x`` (the residual stream's) there, so neither the normalized rows'
gradient nor the sum of ``x``'s two gradients makes a round trip. It also writes the normalized rows (the weight
gradient's operand, one cuBLAS GEMM) and per-program column sums for the norm's and the bias's gradients
(summed once afterwards: deterministic, no atomics).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from opengem.ops.triton.tuning import autotune

# (BLOCK_M, BLOCK_N, num_warps, num_stages). Session 39's first tiles (BLOCK_N 128-256, 3 stages) held one program
# per SM (a [K, BLOCK_N] weight tile per stage) and ran the forward at 0.60x the compiled LayerNorm + cuBLAS on an H100:
# the row loads, the products and the stores of one program do not overlap, so smaller tiles, two or three programs
# an SM, are the candidates too.
_FORWARD_TILES = ((64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (32, 64, 4, 2), (32, 128, 4, 2), (32, 32, 4, 3),
                  (64, 64, 8, 2), (64, 128, 4, 2))  # fmt: skip
_BACKWARD_TILES = ((32, 64, 4, 3), (64, 64, 8, 3), (32, 32, 4, 3), (16, 64, 4, 3), (16, 32, 4, 3), (16, 128, 4, 2))
# The forward holds a [BLOCK_M, K] bf16 row block, the backward a [BLOCK_M, K] fp32 accumulator and the fp32 rows.
_FORWARD_ROW_BLOCK, _BACKWARD_ROW_BLOCK = 128 * 256, 64 * 256  # BLOCK_M * K_PAD at most
SHARED_MEMORY = 232_448  # bytes a program may use on sm_90
MAX_ROW = 512  # widest row the kernels take (the backward holds a [BLOCK_M, K] fp32 tile)


def _configs(tiles: tuple[tuple[int, int, int, int], ...]) -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET") == "1":  # one config: Triton's autotuner times even a lone survivor
        tiles = ((16, 32, 4, 1),)
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]


def shared_bytes(config: triton.Config, k_pad: int, forward: bool) -> int:
    """Shared memory a tile asks for (2-byte operands): the forward's row block and a weight tile per stage; the
    backward's ``dy`` and weight tiles per stage."""
    m, n, stages = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_stages
    return 2 * (m * k_pad + stages * k_pad * n) if forward else 2 * stages * (m * n + n * k_pad)


def _pruned_to(row_block: int, forward: bool):
    def prune(tiles: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
        """The tiles whose row block fits registers and whose operands fit shared memory at this row width (K_PAD
        512 halves BLOCK_M), else the one asking for the least shared memory."""
        k_pad = kwargs.get("K_PAD", named_args.get("K_PAD"))  # Triton passes the launch's keyword arguments apart
        kept = [c for c in tiles if c.kwargs["BLOCK_M"] * k_pad <= row_block
                and shared_bytes(c, k_pad, forward) <= SHARED_MEMORY]  # fmt: skip
        return kept or [min(tiles, key=lambda c: shared_bytes(c, k_pad, forward))]

    return {"early_config_prune": prune}


@autotune(configs=_configs(_FORWARD_TILES), key=["N", "K_PAD", "HAS_BIAS"],
          prune_configs_by=_pruned_to(_FORWARD_ROW_BLOCK, forward=True))
@triton.jit(do_not_specialize=["M"])
def _forward_kernel(
    x, gamma, beta, weight, bias, y, row_mean, row_rstd, M, N, K, eps,
    K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, K_PAD)
    row_ok, col_ok = rows < M, cols < K
    row_start = rows.to(tl.int64)[:, None] * K
    xs = tl.load(x + row_start + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    mean = tl.sum(xs, axis=1) / K
    centered = tl.where(col_ok[None, :], xs - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / K + eps)
    tl.store(row_mean + rows, mean, mask=row_ok)
    tl.store(row_rstd + rows, rstd, mask=row_ok)
    g = tl.load(gamma + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(beta + cols, mask=col_ok, other=0.0).to(tl.float32)
    normed = (centered * rstd[:, None] * g[None, :] + b[None, :]).to(weight.dtype.element_ty)
    out_start = rows.to(tl.int64)[:, None] * N
    for n0 in range(0, N, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        n_ok = ns < N
        w = tl.load(weight + ns[None, :] * K + cols[:, None], mask=col_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(normed, w, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y + out_start + ns[None, :], acc.to(y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@autotune(configs=_configs(_BACKWARD_TILES), key=["N", "K_PAD", "HAS_PASS", "BIAS_GRAD"],
          prune_configs_by=_pruned_to(_BACKWARD_ROW_BLOCK, forward=False))  # fmt: skip
@triton.jit(do_not_specialize=["M"])
def _backward_kernel(
    dy, weight, x, row_mean, row_rstd, gamma, beta, d_pass, dx, normed_out, gamma_part, beta_part, bias_part,
    M, N, K, K_PAD: tl.constexpr, HAS_PASS: tl.constexpr, BIAS_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    rows = program * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, K_PAD)
    row_ok, col_ok = rows < M, cols < K
    grad_start = rows.to(tl.int64)[:, None] * N
    d_normed = tl.zeros((BLOCK_M, K_PAD), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        n_ok = ns < N
        g_out = tl.load(dy + grad_start + ns[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        w = tl.load(weight + ns[:, None] * K + cols[None, :], mask=n_ok[:, None] & col_ok[None, :], other=0.0)
        d_normed = tl.dot(g_out, w, d_normed, input_precision=DOT_PRECISION)
        if BIAS_GRAD:
            tl.store(bias_part + program * N + ns, tl.sum(g_out.to(tl.float32), axis=0), mask=n_ok)
    tile = row_ok[:, None] & col_ok[None, :]
    row_start = rows.to(tl.int64)[:, None] * K
    xs = tl.load(x + row_start + cols[None, :], mask=tile, other=0.0).to(tl.float32)
    mean = tl.load(row_mean + rows, mask=row_ok, other=0.0)
    rstd = tl.load(row_rstd + rows, mask=row_ok, other=0.0)
    x_hat = tl.where(tile, (xs - mean[:, None]) * rstd[:, None], 0.0)
    g = tl.load(gamma + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(beta + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(normed_out + row_start + cols[None, :], (x_hat * g[None, :] + b[None, :]).to(normed_out.dtype.element_ty),
             mask=tile)  # fmt: skip
    tl.store(gamma_part + program * K + cols, tl.sum(d_normed * x_hat, axis=0), mask=col_ok)
    tl.store(beta_part + program * K + cols, tl.sum(d_normed, axis=0), mask=col_ok)
    d_hat = d_normed * g[None, :]
    mean_d_hat = tl.sum(d_hat, axis=1) / K
    mean_d_hat_x_hat = tl.sum(d_hat * x_hat, axis=1) / K
    grad = rstd[:, None] * (d_hat - mean_d_hat[:, None] - x_hat * mean_d_hat_x_hat[:, None])
    if HAS_PASS:
        grad += tl.load(d_pass + row_start + cols[None, :], mask=tile, other=0.0).to(tl.float32)
    tl.store(dx + row_start + cols[None, :], grad.to(dx.dtype.element_ty), mask=tile)


def picked_tiles() -> dict[str, dict[str, str]]:
    """The tile each tuner picked, by its tuning key (for benchmarks' records)."""
    return {name: {str(key): str(config) for key, config in tuner.cache.items()}
            for name, tuner in (("forward", _forward_kernel), ("backward", _backward_kernel))}  # fmt: skip


def _row_tile(k: int) -> int:
    return max(16, triton.next_power_of_2(k))  # tl.dot takes inner sizes of 16 and up


def _dot_precision(weight: torch.Tensor) -> str:
    return "ieee" if weight.dtype == torch.float32 else "tf32"  # fp32 weights get fp32 products, not TF32's


def norm_linear_forward(
    x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (contiguous, any float dtype), ``weight [N, K]`` -> ``(y [M, N]`` in the weight's dtype, row
    mean, row rstd ``[M]`` fp32)."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=weight.dtype, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if M == 0:
        return y, mean, rstd
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]),)  # noqa: E731
    _forward_kernel[grid](x, gamma, beta, weight, y if bias is None else bias, y, mean, rstd, M, N, K, eps,
                          K_PAD=_row_tile(K), HAS_BIAS=bias is not None, DOT_PRECISION=_dot_precision(weight))
    return y, mean, rstd


def norm_linear_backward(
    dy: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
    gamma: torch.Tensor, beta: torch.Tensor, d_pass: torch.Tensor | None, bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dx, normed rows [M, K]`` in the weight's dtype, ``d_gamma, d_beta`` fp32 ``[K]``, ``d_bias`` fp32 ``[N]``
    or None): ``dx`` in ``x``'s dtype, ``d_pass`` (``x``'s other gradient) added."""
    M, K = x.shape
    N = weight.shape[0]
    k_pad = _row_tile(K)
    if M == 0:
        columns = torch.zeros(K, dtype=torch.float32, device=x.device)
        d_bias = torch.zeros(N, dtype=torch.float32, device=x.device) if bias_grad else None
        normed = torch.empty((0, K), dtype=weight.dtype, device=x.device)
        return torch.empty_like(x), normed, columns, columns.clone(), d_bias
    smallest_block = min(c.kwargs["BLOCK_M"] for c in _backward_kernel.configs)
    programs = triton.cdiv(M, smallest_block)  # room for the partial sums of any tile the tuner tries
    dx = torch.empty_like(x)
    normed = torch.empty((M, K), dtype=weight.dtype, device=x.device)
    gamma_part = torch.empty((programs, K), dtype=torch.float32, device=x.device)
    beta_part = torch.empty_like(gamma_part)
    bias_part = torch.empty((programs if bias_grad else 1, N), dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]),)  # noqa: E731
    _backward_kernel[grid](dy, weight, x, mean, rstd, gamma, beta, dx if d_pass is None else d_pass, dx, normed,
                           gamma_part, beta_part, bias_part, M, N, K, K_PAD=k_pad, HAS_PASS=d_pass is not None,
                           BIAS_GRAD=bias_grad, DOT_PRECISION=_dot_precision(weight))  # fmt: skip
    used = triton.cdiv(M, _backward_kernel.best_config.kwargs["BLOCK_M"])  # the rows the pick's programs wrote
    d_bias = bias_part[:used].sum(0) if bias_grad else None
    return dx, normed, gamma_part[:used].sum(0), beta_part[:used].sum(0), d_bias
