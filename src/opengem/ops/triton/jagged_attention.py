"""Jagged Flash Attention (JFA) Triton kernels: forward, dK/dV pass, dQ pass, and the host tile scheduler.

Layout: q ``[T, H, D]``, k and v ``[T, H_kv, D]`` (any strides with a unit last dim), ``offsets [B + 1]``.
The log-sum-exp is saved as ``[H, T]`` fp32 in base 2 (the kernels work with ``exp2``, folding
``log2(e)`` into the scale). No autograd here: :mod:`opengem.ops.jagged_attention` wires it.

Work is launched per (sample, tile) item from a host-built schedule: only tiles holding tokens exist,
ordered longest-work-first so that the long sequences of a heavy-tailed batch start first. Inside a
program, the key (or query) loop is split into tiles that need the mask and tiles every pair of which
is visible, which run without it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from opengem.jagged.host import host_copy, to_device
from opengem.ops.triton.masks import key_range, tile_mask
from opengem.ops.triton.mx import mx_e4m3_rows
from opengem.ops.triton.ragged_tiles import (
    last_dim_contiguous,
    ragged_descriptor,
    ragged_tile,
    set_block_rows,
    tma_ok,
    tma_passes,
)
from opengem.ops.triton.tuning import autotune

LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter cannot benchmark configs; its tiny, unequal tiles make the tests cross tile borders.
_TILES = (16, 32) if _INTERPRET else (64, 128)
_SMALL, _LARGE = _TILES

# (BLOCK_M, BLOCK_N, num_warps, num_stages); the first of each list is the untuned default. A curated
# subset of {64, 128}^2 x {4, 8} x {2, 3, 4} keeps first-call tuning short; OPENGEM_JFA_AUTOTUNE=full
# tries the whole product, =0 only the default.
# (64, 64, 4, 2) forward: for short sequences, where 64 x 64 at 3 stages was picked and ran 0.97x flash (B 1152,
# max length 512, non-causal, session 8); fewer stages, more programs per SM.
# (64, 32, 4, 3) / (64, 32, 4, 4): 32-key tiles, outside the {64, 128}^2 product, after they won GDPA's forward: on
# JFA's forward at B 1152, max length 512, sparsity 0.5, non-causal 0.659 / 0.682 ms against 0.768 for the best of
# the product (64 x 64 x 3); at sparsity 1.0 and at L1024 within 2% of the best (H200, session 24).
# (64, 64, 4, 2) capped at 168 registers (183 uncapped, two programs an SM; capped, a third, as for the FP8 forward's
# winning tile) ran 2.080 ms hot on (a) against 1.812 for 128 x 128 x 8 x 3, and 0.777 against 0.699 on (c) (H200,
# session 29): not a candidate.
_FWD = [
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3), (128, 128, 8, 2),
    (64, 64, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4),
]  # fmt: skip
# (64, 64, 4, 2) in the backward: the best dK/dV and dQ tiles of the full product on short causal sequences
# (B 1152, max length 512 at sparsity 0.5, H200, session 7: backward 2.69 -> 2.53 ms for dK/dV, -> 2.62 for
# dQ), where programs are short and occupancy counts (sm_90 shared memory: 99 KB, two programs per SM,
# against 132 KB at 3 stages); (64, 64, 4, 1) takes 66 KB, three per SM (not measured in that sweep).
# (32, 64, 4, 3) dK/dV: 32 query rows a step (GDPA's backward tile): no spills at sm_90 where 64 x 128 spills; the
# backward at B 1152, max length 1024, sparsity 0.5, causal 5.64 ms against 5.92 on the tuner's 64 x 64 x 2, and
# equal (2.44 / 2.45) non-causal at 512 (H200, session 26).
_DKDV = [
    (64, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 1), (32, 64, 4, 3),
]  # fmt: skip
_DQ = [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 1)]
_FULL = [(m, n, w, s) for m in (64, 128) for n in (64, 128) for w in (4, 8) for s in (2, 3, 4)]


def full_product(name: str) -> list[tuple[int, int, int, int]]:
    """``OPENGEM_JFA_AUTOTUNE=full``'s tiles of kernel ``name``, less those whose first dot has under 16 rows per
    warp (BLOCK_N in dK/dV, else BLOCK_M): Triton lays a chained dot's warps along its rows, so those would
    compute it on two warpgroups at once (``benchmarks.sass.replicated_dots``)."""
    return [c for c in _FULL if (c[1] if name == "dkdv" else c[0]) >= 16 * c[2]]


# (the forward's key tiles hold whole MX blocks of 32 keys, for precision="mxfp8")
_INTERPRETER_TILES = {"fwd": (16, 32), "dkdv": (16, 32), "dq": (32, 16)}


# The tensors each kernel reads in query-tile rows (BLOCK_M) and key-tile rows (BLOCK_N), by argument name.
_TILE_ROWS = {"fwd": (("Q",), ("K", "V")), "dkdv": (("Q", "DO"), ()), "dq": (("Q", "DO", "O"), ("K", "V"))}


def _tma_block_shapes(name: str):
    """Autotuner pre-hook: the ragged TMA descriptors' boxes follow the config's tile sizes."""
    rows_m, rows_n = _TILE_ROWS[name]

    def hook(nargs: dict) -> None:
        for names, block in ((rows_m, nargs["BLOCK_M"]), (rows_n, nargs["BLOCK_N"])):
            for arg in names:
                set_block_rows(nargs[f"{arg}_desc"], block)

    return hook


def tile_config(
    name: str, block_m: int, block_n: int, num_warps: int, num_stages: int, pointer_loads: bool = False
) -> triton.Config:
    """A config of kernel ``name`` (fwd, dkdv, dq), with the pre-hook that sizes its TMA boxes;
    ``pointer_loads`` (dK/dV only): masked pointer loads even where TMA descriptors were passed. The tile the host
    schedules (dK/dV's key tile, the others' query tile) must be one of the schedule's sizes."""
    scheduled, label = (block_n, "BLOCK_N") if name == "dkdv" else (block_m, "BLOCK_M")
    if scheduled not in _TILES:
        raise ValueError(f"JFA {name} tile {block_m}x{block_n}: {label} = {scheduled} is not a scheduled tile size "
                         f"{_TILES} (the host lists the {name} kernel's tiles in those sizes)")
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n} | ({"POINTER_LOADS": True} if pointer_loads else {}),
                         num_warps=num_warps, num_stages=num_stages, pre_hook=_tma_block_shapes(name))


# dK/dV is tuned over both load paths: with k and v through TMA too, it ran 12% slower on workload (a) (3.94
# -> 4.42 ms, the 64 x 128 8-warp tile lost its lead) and 3-7% faster on short causal batches (H200, session
# 8). Since then k and v are pointer loads on both paths (sm_90 spills 176-272 -> 16-80 B): the TMA path ran
# 7-14% faster than pointer loads on short causal batches, and the tuner still picked pointer loads for
# causal batches of length 4096 (session 9). Forward and dQ were as fast or faster with TMA everywhere measured.
_BOTH_LOAD_PATHS = {"dkdv"}


def _configs(name: str, curated: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    if _INTERPRET:
        return [tile_config(name, *_INTERPRETER_TILES[name], 1, 1)]
    full = os.environ.get("OPENGEM_JFA_AUTOTUNE") == "full"
    choices = [curated[0], *(c for c in full_product(name) if c != curated[0])] if full else curated
    paths = (False, True) if name in _BOTH_LOAD_PATHS else (False,)
    return [tile_config(name, *choice, pointer_loads=pointer) for choice in choices for pointer in paths]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop configs that cannot fit: 256 bytes-of-bf16 rows (D = 256 in 16-bit, or D = 128 in fp32, which
    overflowed shared memory on an H200 in the dK/dV pass) need smaller tiles and shallower pipelines."""
    if os.environ.get("OPENGEM_JFA_AUTOTUNE") == "0":
        configs = configs[:1]
    if not kwargs.get("USE_TMA", named_args.get("USE_TMA", False)):  # no descriptors: both paths are pointer loads
        configs = [c for c in configs if not c.kwargs.get("POINTER_LOADS")]
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    if _INTERPRET or head_dim is None or _row_width(head_dim, named_args.get("Q")) < 256:
        return configs
    kept: dict[tuple, triton.Config] = {}
    smallest = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=1, pre_hook=configs[0].pre_hook)
    for c in [*configs, smallest]:
        m, n = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        if m * n <= 64 * 128:
            stages = min(c.num_stages, 2)
            shallower = triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=stages, pre_hook=c.pre_hook)
            kept.setdefault((m, n, c.num_warps, stages, c.kwargs.get("POINTER_LOADS")), shallower)
    return list(kept.values())


def _row_width(head_dim: int, q: torch.Tensor | None) -> int:
    """Head dim in 16-bit units: what the tiles' shared memory scales with."""
    return head_dim * (q.element_size() // 2 if q is not None else 1)


TUNING_BUCKET_CAP = 8192  # one bucket for every batch whose longest sequence passes 4096


def tuning_bucket(max_len: int) -> int:
    """The length part of the autotuning key: powers of two from 16 up to 4096, then one bucket for longer.
    A power-law batch whose longest history swings between 8k and 16k keeps one key instead of re-tuning
    (seconds of timing on the host) whenever it crosses a power of two. 4096 and longer are apart because
    they tune differently: sharing one key, uniform lengths up to 4096 (B 1152, sparsity 0.5, causal) ran on
    the 64 x 64 tiles the power-law batch (100..16384) had picked: 0.87x / 0.85x flash's forward / backward,
    against 1.09x / 0.99x in the session's first run, whose shared pick had 128-row tiles (H200, session 8)."""
    return min(TUNING_BUCKET_CAP, max(16, triton.next_power_of_2(max(max_len, 1))))


_KEY = ["LEN_BUCKET", "HEAD_DIM", "GROUP", "CAUSAL", "HAS_WINDOW", "HAS_CONTEXT", "HAS_TARGETS"]
_TUNING = dict(key=[*_KEY, "USE_TMA"], prune_configs_by={"early_config_prune": _prune})


# ----------------------------------------------------------------------------------------------- helpers


@triton.jit
def _sample(offsets, num_targets, b, HAS_TARGETS: tl.constexpr):
    """(first row, length, history length) of sample ``b``."""
    start = tl.load(offsets + b).to(tl.int64)
    seq_len = (tl.load(offsets + b + 1) - start).to(tl.int32)
    hist_len = seq_len
    if HAS_TARGETS:
        hist_len = seq_len - tl.load(num_targets + b).to(tl.int32)
    return start, seq_len, hist_len


@triton.jit
def _item(sched_small, sched_large, heads, BLOCK: tl.constexpr, SMALL: tl.constexpr):
    """(sample, first row of the tile, head) of this program, from the schedule built for ``BLOCK``.

    Heads vary fastest so that launch order follows the schedule's longest-first order across heads."""
    item = tl.program_id(0) // heads
    head = tl.program_id(0) % heads
    if BLOCK == SMALL:
        b = tl.load(sched_small + 2 * item)
        row = tl.load(sched_small + 2 * item + 1)
    else:
        b = tl.load(sched_large + 2 * item)
        row = tl.load(sched_large + 2 * item + 1)
    return b, row, head


@triton.jit
def _row_max_scaled(s, scale_log2, NEGATIVE_SCALE: tl.constexpr):
    """Row maximum of ``s * scale_log2`` from the raw logits, so that the exponent is one FMA per pair."""
    if NEGATIVE_SCALE:
        return tl.min(s, 1) * scale_log2
    return tl.max(s, 1) * scale_log2


@triton.jit
def _key_tiles(
    m_start, seq_len, hist_len, contextual_len, window,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr,
):  # fmt: skip
    """Key loop of a query tile: ``[lo, f_lo)`` masked, ``[f_lo, f_hi)`` fully visible, ``[f_hi, hi)`` masked."""
    lo, hi = key_range(m_start, seq_len, hist_len, contextual_len, window, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
    lo = (lo // BLOCK_N) * BLOCK_N
    m_end = tl.minimum(m_start + BLOCK_M, seq_len)
    p_first = tl.minimum(m_start, hist_len)
    p_last = tl.minimum(m_end - 1, hist_len)
    # keys in [full_lo, full_hi) are visible to every row of the tile (a contextual prefix only adds)
    full_lo = 0
    full_hi = hist_len
    if CAUSAL:
        full_hi = tl.minimum(full_hi, p_first + 1)
    if HAS_WINDOW:
        full_lo = p_last - window
        if not CAUSAL:
            full_hi = tl.minimum(full_hi, p_first + window + 1)
    f_lo = lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N
    f_hi = lo + (tl.maximum(full_hi - lo, 0) // BLOCK_N) * BLOCK_N
    f_lo = tl.minimum(f_lo, hi)
    f_hi = tl.minimum(tl.maximum(f_hi, f_lo), hi)
    return lo, f_lo, f_hi, hi


@triton.jit
def _query_tiles(
    n_start, seq_len, hist_len, contextual_len, window,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr,
):  # fmt: skip
    """Query loop of a key tile: ``[0, c_hi)`` contextual rows (masked), then ``[lo, f_lo)`` masked,
    ``[f_lo, f_hi)`` fully visible, ``[f_hi, hi)`` masked. Rows past the sample are zero-filled and add 0."""
    n_end = tl.minimum(n_start + BLOCK_N, seq_len)
    lo = n_start
    hi = n_end
    c_hi = 0
    f_lo = hi
    f_hi = hi
    if n_start < hist_len:  # tiles of targets only are seen by their own rows only
        j_last = tl.minimum(n_end, hist_len) - 1
        lo = 0
        hi = seq_len
        if CAUSAL:
            lo = n_start
        if HAS_WINDOW:
            if not CAUSAL:
                lo = tl.maximum(0, n_start - window)
            if j_last + window < hist_len:  # targets (position hist_len) cannot reach this tile
                hi = tl.minimum(seq_len, j_last + window + 1)
        lo = (tl.minimum(lo, n_start) // BLOCK_M) * BLOCK_M
        hi = tl.maximum(hi, n_end)
        if HAS_CONTEXT:
            c_hi = tl.minimum(tl.cdiv(contextual_len, BLOCK_M) * BLOCK_M, lo)
        f_lo = hi
        f_hi = hi
        if n_end <= hist_len:
            # rows in [full_lo, full_hi) see every key of the tile
            full_lo = 0
            if CAUSAL:
                full_lo = n_end - 1
            elif HAS_WINDOW:
                full_lo = n_end - 1 - window
            f_lo = tl.minimum(lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_M) * BLOCK_M, hi)
            f_hi = hi
            if HAS_WINDOW:
                if tl.minimum(seq_len - 1, hist_len) > n_start + window:
                    f_hi = lo + (tl.maximum(n_start + window + 1 - lo, 0) // BLOCK_M) * BLOCK_M
            f_hi = tl.minimum(tl.maximum(f_hi, f_lo), hi)
    else:
        lo = (lo // BLOCK_M) * BLOCK_M
    return c_hi, lo, f_lo, f_hi, hi


# ----------------------------------------------------------------------------------------------- forward


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, K, V, K_desc, V_desc, start, h_kv, stride_kt, stride_vt, n_lo, n_hi,
    offs_m, offs_d, seq_len, hist_len, contextual_len, window, scale_log2,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr, P_MX: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    """Key tiles ``[n_lo, n_hi)`` of one query tile; ``P_MX``: P quantized to MX-E4M3 before ``P V``
    (``precision="mxfp8"``, :mod:`opengem.ops.reference.attention_mxfp8`), the running maximum kept on integers
    so that every rescale is a power of two, which MX quantization commutes with."""
    for n_start in range(n_lo, n_hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        if USE_TMA:
            kT = tl.trans(ragged_tile(K_desc, start, seq_len, n_start, h_kv, BLOCK_N, HEAD_DIM))
            v = ragged_tile(V_desc, start, seq_len, n_start, h_kv, BLOCK_N, HEAD_DIM)
        else:
            kT_ptrs = K + offs_n[None, :] * stride_kt + offs_d[:, None]
            v_ptrs = V + offs_n[:, None] * stride_vt + offs_d[None, :]
            if MASKED:
                kT = tl.load(kT_ptrs, mask=offs_n[None, :] < seq_len, other=0.0)
                v = tl.load(v_ptrs, mask=offs_n[:, None] < seq_len, other=0.0)
            else:
                kT = tl.load(kT_ptrs)
                v = tl.load(v_ptrs)
        s = tl.dot(q, kT, input_precision=PRECISION)
        # online softmax in base 2: rescale the running sum and accumulator to the new row maximum
        if MASKED:
            visible = tile_mask(offs_m, offs_n, seq_len, hist_len, contextual_len, window, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if P_MX:
                m_new = tl.math.ceil(m_new)
            p = tl.math.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, _row_max_scaled(s, scale_log2, NEGATIVE_SCALE))
            if P_MX:
                m_new = tl.math.ceil(m_new)
            p = tl.math.exp2(s * scale_log2 - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if P_MX:  # (its values have 4 significant bits: the cast to v's dtype below is exact in 16 bits)
            p = mx_e4m3_rows(p, offs_m.shape[0], BLOCK_N, EXACT)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@autotune(configs=_configs("fwd", _FWD), **_TUNING)
@triton.jit(do_not_specialize=["contextual_len", "window", "total_tokens", "heads"])
def _fwd_kernel(
    Q, K, V, O, LSE, offsets, num_targets, sched_small, sched_large, Q_desc, K_desc, V_desc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    total_tokens, heads, scale_log2, contextual_len, window, LEN_BUCKET,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_TARGETS: tl.constexpr, SMALL: tl.constexpr, PRECISION: tl.constexpr,
    NEGATIVE_SCALE: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    P_MX: tl.constexpr = False, EXACT: tl.constexpr = False,
):  # fmt: skip
    b, m_start, h = _item(sched_small, sched_large, heads, BLOCK_M, SMALL)
    start, seq_len, hist_len = _sample(offsets, num_targets, b, HAS_TARGETS)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    if USE_TMA:
        q = ragged_tile(Q_desc, start, seq_len, m_start, h, BLOCK_M, HEAD_DIM)
    else:
        q = tl.load(Q + (start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    h_kv = h // GROUP
    K += start * stride_kt + h_kv * stride_kh
    V += start * stride_vt + h_kv * stride_vh
    # a finite initial maximum keeps rows that see nothing in a tile free of inf - inf
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, f_lo, f_hi, hi = _key_tiles(m_start, seq_len, hist_len, contextual_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, K_desc, V_desc, start, h_kv, stride_kt, stride_vt, lo, f_lo,
                               offs_m, offs_d, seq_len, hist_len, contextual_len, window, scale_log2, BLOCK_N,
                               HEAD_DIM, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, NEGATIVE_SCALE, USE_TMA, PRECISION,
                               P_MX, EXACT)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, K_desc, V_desc, start, h_kv, stride_kt, stride_vt, f_lo, f_hi,
                               offs_m, offs_d, seq_len, hist_len, contextual_len, window, scale_log2, BLOCK_N,
                               HEAD_DIM, False, CAUSAL, HAS_WINDOW, HAS_CONTEXT, NEGATIVE_SCALE, USE_TMA, PRECISION,
                               P_MX, EXACT)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, K_desc, V_desc, start, h_kv, stride_kt, stride_vt, f_hi, hi,
                               offs_m, offs_d, seq_len, hist_len, contextual_len, window, scale_log2, BLOCK_N,
                               HEAD_DIM, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, NEGATIVE_SCALE, USE_TMA, PRECISION,
                               P_MX, EXACT)
    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # only rows past the sample see nothing
    out = acc / l_i[:, None]
    tl.store(O + (start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + h * total_tokens + start + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)  # fmt: skip


# ---------------------------------------------------------------------------------------------- backward


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, Q, DO, Q_desc, DO_desc, start, h, LSE, Delta, stride_qt, stride_dot, m_lo, m_hi,
    offs_n, offs_d, seq_len, hist_len, contextual_len, window, scale_log2,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate the dK, dV of one key tile over query tiles ``[m_lo, m_hi)`` of one head (transposed: [N, M])."""
    for m_start in range(m_lo, m_hi, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seq_len
        # rows past the sample load as zeros (q, dO, lse, delta): their terms vanish without a mask
        if USE_TMA:
            qT = tl.trans(ragged_tile(Q_desc, start, seq_len, m_start, h, BLOCK_M, HEAD_DIM))
            do = ragged_tile(DO_desc, start, seq_len, m_start, h, BLOCK_M, HEAD_DIM)
        else:
            qT = tl.load(Q + offs_m[None, :] * stride_qt + offs_d[:, None], mask=row_ok[None, :], other=0.0)
            do = tl.load(DO + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(Delta + offs_m, mask=row_ok, other=0.0)
        pT = tl.math.exp2(tl.dot(k, qT, input_precision=PRECISION) * scale_log2 - lse[None, :])  # P^T [N, M]
        if MASKED:
            visible = tile_mask(offs_m, offs_n, seq_len, hist_len, contextual_len, window, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
            pT = tl.where(tl.trans(visible), pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)  # dV = P^T dO
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # dP^T = V dO^T
        dsT = pT * (dpT - delta[None, :])  # dS = P * (dP - delta), gradient of the (scaled) logits
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PRECISION)  # dK = dS^T Q (scaled later)
    return dk, dv


@triton.jit
def _store_column_sums(
    Sums, tile_starts, b, row_start, seq_len, part, h, heads, grad, rows_ok, offs_d,
    BLOCK: tl.constexpr, SMALL: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The column sum of one tile's gradient ``grad [BLOCK, D]`` (fp32, rows past the sample excluded) into
    ``Sums [small tiles, 3, heads, D]`` at (this tile's first SMALL-row tile, ``part``, ``h``). A tile of
    ``BLOCK > SMALL`` rows covers ``BLOCK / SMALL`` small tiles: the others that hold rows get zeros, so every row of
    ``Sums`` is written whichever tile size the autotuner ran (its candidates' runs leave nothing stale behind)."""
    tile = tl.load(tile_starts + b).to(tl.int64) + row_start // SMALL
    column_sum = tl.sum(tl.where(rows_ok, grad, 0.0), 0)
    tl.store(Sums + ((tile * 3 + part) * heads + h) * HEAD_DIM + offs_d, column_sum)
    for j in tl.static_range(1, BLOCK // SMALL):
        holds_rows = offs_d * 0 + row_start + j * SMALL < seq_len  # (a vector: the interpreter takes no scalar mask)
        tl.store(Sums + (((tile + j) * 3 + part) * heads + h) * HEAD_DIM + offs_d, tl.zeros_like(column_sum),
                 mask=holds_rows)


@autotune(configs=_configs("dkdv", _DKDV), **_TUNING)
@triton.jit(do_not_specialize=["contextual_len", "window", "total_tokens", "heads"])
def _dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, offsets, num_targets, sched_small, sched_large, Q_desc, DO_desc,
    Sums, tile_starts,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    total_tokens, heads, scale, scale_log2, contextual_len, window, LEN_BUCKET,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_TARGETS: tl.constexpr, SMALL: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, COLUMN_SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    POINTER_LOADS: tl.constexpr = False,
):  # fmt: skip
    """dK, dV of one key tile; with ``COLUMN_SUMS``, also their column sums (parts 1 and 2 of ``Sums``)."""
    TMA: tl.constexpr = USE_TMA and not POINTER_LOADS  # POINTER_LOADS: the tuner's other path (a config kwarg)
    b, n_start, h_kv = _item(sched_small, sched_large, heads, BLOCK_N, SMALL)
    start, seq_len, hist_len = _sample(offsets, num_targets, b, HAS_TARGETS)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n[:, None] < seq_len
    # k and v by pointer loads whatever the path: loaded once per program, they stay shared-memory MMA
    # operands; through the 5-D ragged descriptor (its reshape) Triton moved them into 64 registers
    k = tl.load(K + (start + offs_n[:, None]) * stride_kt + h_kv * stride_kh + offs_d[None, :], mask=key_ok, other=0.0)
    v = tl.load(V + (start + offs_n[:, None]) * stride_vt + h_kv * stride_vh + offs_d[None, :], mask=key_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    c_hi, lo, f_lo, f_hi, hi = _query_tiles(n_start, seq_len, hist_len, contextual_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
    # GQA: the q heads sharing this kv head add into the same dK, dV (no atomics)
    for g in range(GROUP):
        h = h_kv * GROUP + g
        Qh = Q + start * stride_qt + h * stride_qh
        DOh = DO + start * stride_dot + h * stride_doh
        LSEh = LSE + h * total_tokens + start
        Dh = Delta + h * total_tokens + start
        dk, dv = _dkdv_tiles(dk, dv, k, v, Qh, DOh, Q_desc, DO_desc, start, h, LSEh, Dh, stride_qt, stride_dot, 0,
                             c_hi, offs_n, offs_d, seq_len, hist_len, contextual_len, window, scale_log2, BLOCK_M,
                             HEAD_DIM, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, TMA, PRECISION)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Qh, DOh, Q_desc, DO_desc, start, h, LSEh, Dh, stride_qt, stride_dot, lo,
                             f_lo, offs_n, offs_d, seq_len, hist_len, contextual_len, window, scale_log2, BLOCK_M,
                             HEAD_DIM, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, TMA, PRECISION)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Qh, DOh, Q_desc, DO_desc, start, h, LSEh, Dh, stride_qt, stride_dot, f_lo,
                             f_hi, offs_n, offs_d, seq_len, hist_len, contextual_len, window, scale_log2, BLOCK_M,
                             HEAD_DIM, False, CAUSAL, HAS_WINDOW, HAS_CONTEXT, TMA, PRECISION)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Qh, DOh, Q_desc, DO_desc, start, h, LSEh, Dh, stride_qt, stride_dot, f_hi,
                             hi, offs_n, offs_d, seq_len, hist_len, contextual_len, window, scale_log2, BLOCK_M,
                             HEAD_DIM, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, TMA, PRECISION)
    dk = dk * scale
    tl.store(DK + (start + offs_n[:, None]) * stride_dkt + h_kv * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + (start + offs_n[:, None]) * stride_dvt + h_kv * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=key_ok)  # fmt: skip
    if COLUMN_SUMS:
        _store_column_sums(Sums, tile_starts, b, n_start, seq_len, 1, h_kv, heads, dk, key_ok, offs_d, BLOCK_N, SMALL, HEAD_DIM)
        _store_column_sums(Sums, tile_starts, b, n_start, seq_len, 2, h_kv, heads, dv, key_ok, offs_d, BLOCK_N, SMALL, HEAD_DIM)  # fmt: skip


@triton.jit
def _dq_tiles(
    dq, q, do, lse, delta, K, V, K_desc, V_desc, start, h_kv, stride_kt, stride_vt, n_lo, n_hi,
    offs_m, offs_d, seq_len, hist_len, contextual_len, window, scale_log2,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    for n_start in range(n_lo, n_hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        # keys past the sample load as zeros: their dS * K terms vanish
        if USE_TMA:
            kT = tl.trans(ragged_tile(K_desc, start, seq_len, n_start, h_kv, BLOCK_N, HEAD_DIM))
            vT = tl.trans(ragged_tile(V_desc, start, seq_len, n_start, h_kv, BLOCK_N, HEAD_DIM))
        else:
            kT = tl.load(K + offs_n[None, :] * stride_kt + offs_d[:, None], mask=offs_n[None, :] < seq_len, other=0.0)
            vT = tl.load(V + offs_n[None, :] * stride_vt + offs_d[:, None], mask=offs_n[None, :] < seq_len, other=0.0)
        p = tl.math.exp2(tl.dot(q, kT, input_precision=PRECISION) * scale_log2 - lse[:, None])
        if MASKED:
            visible = tile_mask(offs_m, offs_n, seq_len, hist_len, contextual_len, window, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, vT, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)  # dQ = dS K (scaled later)
    return dq


@autotune(configs=_configs("dq", _DQ), **_TUNING)
@triton.jit(do_not_specialize=["contextual_len", "window", "total_tokens", "heads"])
def _dq_kernel(
    Q, K, V, O, DO, LSE, Delta, DQ, offsets, num_targets, sched_small, sched_large,
    Q_desc, K_desc, V_desc, O_desc, DO_desc, Sums, tile_starts,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_dot, stride_doh,
    stride_dqt, stride_dqh,
    total_tokens, heads, scale, scale_log2, contextual_len, window, LEN_BUCKET,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_TARGETS: tl.constexpr, SMALL: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, COLUMN_SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile; runs before the dK/dV pass and writes the tile's softmax-gradient term
    ``delta = rowsum(dO * O)`` ``[H, T]`` fp32 for it (each (row, head) belongs to exactly one item), so the
    backward reads dO once less than with a separate delta kernel. With ``COLUMN_SUMS``, also dQ's column sum
    (part 0 of ``Sums``)."""
    b, m_start, h = _item(sched_small, sched_large, heads, BLOCK_M, SMALL)
    start, seq_len, hist_len = _sample(offsets, num_targets, b, HAS_TARGETS)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    if USE_TMA:
        q = ragged_tile(Q_desc, start, seq_len, m_start, h, BLOCK_M, HEAD_DIM)
        do = ragged_tile(DO_desc, start, seq_len, m_start, h, BLOCK_M, HEAD_DIM)
        o = ragged_tile(O_desc, start, seq_len, m_start, h, BLOCK_M, HEAD_DIM)
    else:
        q = tl.load(Q + (start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + (start + offs_m[:, None]) * stride_dot + h * stride_doh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        o = tl.load(O + (start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + h * total_tokens + start + offs_m, mask=row_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + h * total_tokens + start + offs_m, delta, mask=row_ok)
    h_kv = h // GROUP
    K += start * stride_kt + h_kv * stride_kh
    V += start * stride_vt + h_kv * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, f_lo, f_hi, hi = _key_tiles(m_start, seq_len, hist_len, contextual_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
    dq = _dq_tiles(dq, q, do, lse, delta, K, V, K_desc, V_desc, start, h_kv, stride_kt, stride_vt, lo, f_lo,
                   offs_m, offs_d, seq_len, hist_len, contextual_len, window, scale_log2, BLOCK_N, HEAD_DIM, True,
                   CAUSAL, HAS_WINDOW, HAS_CONTEXT, USE_TMA, PRECISION)
    dq = _dq_tiles(dq, q, do, lse, delta, K, V, K_desc, V_desc, start, h_kv, stride_kt, stride_vt, f_lo, f_hi,
                   offs_m, offs_d, seq_len, hist_len, contextual_len, window, scale_log2, BLOCK_N, HEAD_DIM, False,
                   CAUSAL, HAS_WINDOW, HAS_CONTEXT, USE_TMA, PRECISION)
    dq = _dq_tiles(dq, q, do, lse, delta, K, V, K_desc, V_desc, start, h_kv, stride_kt, stride_vt, f_hi, hi,
                   offs_m, offs_d, seq_len, hist_len, contextual_len, window, scale_log2, BLOCK_N, HEAD_DIM, True,
                   CAUSAL, HAS_WINDOW, HAS_CONTEXT, USE_TMA, PRECISION)
    dq = dq * scale
    tl.store(DQ + (start + offs_m[:, None]) * stride_dqt + h * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip
    if COLUMN_SUMS:
        _store_column_sums(Sums, tile_starts, b, m_start, seq_len, 0, h, heads, dq, row_ok[:, None], offs_d, BLOCK_M, SMALL, HEAD_DIM)  # fmt: skip


# The autotuned kernel of each pass, by the names ``tile_config`` and ``OPENGEM_JFA_TMA`` use.
KERNELS = {"fwd": _fwd_kernel, "dkdv": _dkdv_kernel, "dq": _dq_kernel}


# --------------------------------------------------------------------------------------- host scheduling


@dataclass(frozen=True)
class MaskOptions:
    causal: bool
    contextual_len: int
    window: int | None


@dataclass(frozen=True)
class Schedule:
    """Work items ``[num_items, 2]`` int32 (sample, first row), longest work first, per tile size; and per sample
    the index of its first ``_SMALL``-row tile among all samples' (``[B]`` int32, for the backward's column sums)."""

    query_tiles: dict[int, torch.Tensor]
    key_tiles: dict[int, torch.Tensor]
    small_tile_starts: torch.Tensor
    num_small_tiles: int


_SCHEDULES: OrderedDict[tuple, Schedule] = OrderedDict()
_SCHEDULE_CACHE_SIZE = 64


def _tiles(lengths: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample, first row) of every tile holding tokens; zero-length samples contribute none.

    These are exactly the non-empty tiles: every token sees itself, so no tile with tokens is fully
    masked; what the masks empty is the key (query) range a tile visits, which the kernels bound."""
    counts, first_tile = _tile_counts(lengths, block)
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), counts)
    row = (torch.arange(int(counts.sum())) - first_tile[sample]) * block
    return sample, row


def _tile_counts(lengths: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample, its number of ``block``-row tiles and the index of its first among all samples' tiles."""
    counts = (lengths + block - 1) // block
    return counts, torch.cumsum(counts, 0) - counts


def _order(sample: torch.Tensor, row: torch.Tensor, work: torch.Tensor, device: torch.device) -> torch.Tensor:
    order = torch.argsort(work, descending=True, stable=True)
    return to_device(torch.stack([sample[order], row[order]], 1).to(torch.int32).contiguous(), device)


def _query_tile_work(lengths, hist, block, opts: MaskOptions):
    """Keys visited per query tile (the host mirror of ``key_range``), for ordering only."""
    sample, m_start = _tiles(lengths, block)
    seq, h = lengths[sample], hist[sample]
    m_end = torch.minimum(m_start + block, seq)
    p_first, p_last = torch.minimum(m_start, h), torch.minimum(m_end - 1, h)
    lo, hi = torch.zeros_like(m_start), h.clone()
    if opts.causal:
        hi = torch.minimum(hi, p_last + 1)
    if opts.window is not None:
        lo = (p_first - opts.window).clamp_min(0)
        hi = torch.minimum(hi, p_last + opts.window + 1)
    in_context = m_start < opts.contextual_len
    lo, hi = torch.where(in_context, 0, lo), torch.where(in_context, h, hi)
    return sample, m_start, torch.maximum(hi, m_end) - torch.minimum(lo, m_start)


def _key_tile_work(lengths, hist, block, opts: MaskOptions):
    """Queries visited per key tile (the host mirror of ``_query_tiles``), for ordering only."""
    sample, n_start = _tiles(lengths, block)
    seq, h = lengths[sample], hist[sample]
    n_end = torch.minimum(n_start + block, seq)
    lo = n_start.clone() if opts.causal else torch.zeros_like(n_start)
    hi = seq.clone()
    if opts.window is not None:
        if not opts.causal:
            lo = (n_start - opts.window).clamp_min(0)
        j_last = torch.minimum(n_end, h) - 1
        hi = torch.where(j_last + opts.window < h, torch.minimum(seq, j_last + opts.window + 1), hi)
    targets_only = n_start >= h
    work = torch.where(targets_only, n_end - n_start, torch.maximum(hi, n_end) - torch.minimum(lo, n_start))
    work = work + torch.where(targets_only, 0, opts.contextual_len)  # the contextual rows' loop
    return sample, n_start, work


def schedule(host_offsets: torch.Tensor, host_targets: torch.Tensor | None, opts: MaskOptions, device: torch.device) -> Schedule:
    """Build (or fetch from the cache) the work items of every tile size the kernels may pick."""
    key = (
        host_offsets.numpy().tobytes(),
        None if host_targets is None else host_targets.numpy().tobytes(),
        opts,
        str(device),
    )
    if key in _SCHEDULES:
        _SCHEDULES.move_to_end(key)
        return _SCHEDULES[key]
    bounds = host_offsets.to(torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    hist = lengths if host_targets is None else lengths - host_targets.to(torch.int64)
    query_tiles, key_tiles = {}, {}
    for block in _TILES:
        query_tiles[block] = _order(*_query_tile_work(lengths, hist, block, opts), device)
        key_tiles[block] = _order(*_key_tile_work(lengths, hist, block, opts), device)
    small_tiles, small_starts = _tile_counts(lengths, _SMALL)
    result = Schedule(query_tiles, key_tiles, to_device(small_starts.to(torch.int32), device), int(small_tiles.sum()))
    _SCHEDULES[key] = result
    if len(_SCHEDULES) > _SCHEDULE_CACHE_SIZE:
        _SCHEDULES.popitem(last=False)
    return result


# ------------------------------------------------------------------------------------------- launchers


@dataclass(frozen=True)
class Problem:
    """Everything the kernels need besides the tensors of one pass."""

    offsets: torch.Tensor
    num_targets: torch.Tensor | None
    sched: Schedule
    opts: MaskOptions
    max_len: int
    scale: float

    def constexprs(self, q: torch.Tensor, k: torch.Tensor) -> dict:
        return dict(
            HEAD_DIM=q.shape[2],
            GROUP=q.shape[1] // k.shape[1],
            CAUSAL=self.opts.causal,
            HAS_WINDOW=self.opts.window is not None,
            HAS_CONTEXT=self.opts.contextual_len > 0,
            HAS_TARGETS=self.num_targets is not None,
            SMALL=_SMALL,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )

    def runtime(self) -> dict:
        return dict(
            contextual_len=self.opts.contextual_len,
            window=self.opts.window if self.opts.window is not None else 0,
            # buckets the length distribution for autotuning; a power of two >= 16 never respecializes
            LEN_BUCKET=tuning_bucket(self.max_len),
        )

    def targets_arg(self) -> torch.Tensor:
        return self.offsets if self.num_targets is None else self.num_targets


def problem(
    offsets: torch.Tensor, num_targets: torch.Tensor | None, opts: MaskOptions, max_len: int, scale: float,
    device: torch.device,
) -> Problem:
    """One call's :class:`Problem`: its tile schedule, built from the offsets' (and targets') host mirrors."""
    host_targets = None if num_targets is None else host_copy(num_targets)
    sched = schedule(host_copy(offsets), host_targets, opts, device)
    targets = None if num_targets is None else num_targets.contiguous()
    return Problem(offsets.contiguous(), targets, sched, opts, max_len, scale)


PASSES = tuple(KERNELS)


def _tma_passes(setting: str) -> frozenset[str]:
    return tma_passes(setting, PASSES, "OPENGEM_JFA_TMA")


# The passes whose tiles load through ragged TMA descriptors (hardware bounds checks, no address math in
# the program) where the tensors allow it; the others use masked pointer loads. Benchmarks may reassign it.
TMA_PASSES = _tma_passes(os.environ.get("OPENGEM_JFA_TMA", ",".join(PASSES)))


def _descriptors(name: str, *tensors: torch.Tensor) -> tuple[list, bool]:
    """Ragged TMA descriptors of ``tensors`` ``[T, H, D]`` for pass ``name`` (their boxes set per config by
    the autotuner's pre-hook) and True, or the tensors themselves and False when any cannot use TMA."""
    if name not in TMA_PASSES or not all(tma_ok(t) for t in tensors):
        return list(tensors), False
    return [ragged_descriptor(t) for t in tensors], True


def _grid(items: dict[int, torch.Tensor], heads: int, block_name: str):
    return lambda meta: (items[meta[block_name]].shape[0] * heads,)


def forward_buffers(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pb: Problem
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor, bool]:
    """What every forward starts with (bf16 and FP8): q, k, v with unit column stride, the empty ``out``
    ``[T, H, D]`` (q's dtype) and ``lse`` ``[H, T]`` fp32, and whether any query tile has work."""
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    total, heads, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((heads, total), device=q.device, dtype=torch.float32)
    return (q, k, v), out, lse, total > 0 and pb.sched.query_tiles[_SMALL].shape[0] > 0


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pb: Problem, p_mx: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out [T, H, D]`` (q's dtype) and ``lse [H, T]`` fp32 (base 2); ``p_mx``: P quantized to MX-E4M3
    before ``P V`` (the MXFP8 forward, on operands the caller quantized)."""
    (q, k, v), out, lse, has_work = forward_buffers(q, k, v, pb)
    if not has_work:
        return out, lse
    total, heads, _ = q.shape
    items = pb.sched.query_tiles
    descs, use_tma = _descriptors("fwd", q, k, v)
    _fwd_kernel[_grid(items, heads, "BLOCK_M")](
        q, k, v, out, lse, pb.offsets, pb.targets_arg(), items[_SMALL], items[_LARGE], *descs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        total, heads, pb.scale * LOG2E, **pb.runtime(), **pb.constexprs(q, k), NEGATIVE_SCALE=pb.scale < 0,
        USE_TMA=use_tma, P_MX=p_mx, EXACT=_INTERPRET,
    )  # fmt: skip
    return out, lse


def backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    pb: Problem, grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv``, written into ``grads`` when given (views with a unit last stride, e.g. of one packed
    ``[T, 3, H, D]`` gradient), else into new tensors.

    Two passes: dQ (which also writes ``delta``), then dK/dV, seven matrix products a tile pair. A fused pass (five:
    the dK/dV programs adding ``dS K`` into an fp32 dQ by atomic or TMA reductions, FlashAttention-2/3's way) ran
    0.80-0.93x this on an H200: 255 registers, spills and one program an SM (session 29; code at commit c127629)."""
    dq, dk, dv, _ = _backward(dout, q, k, v, out, lse, pb, grads, column_sums=False)
    return dq, dk, dv


def backward_with_column_sums(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    pb: Problem, grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`backward`, plus the column sums of dq, dk and dv over all tokens, ``[3, H, D]`` fp32: the gradient of
    a bias the QKV projection added, taken from the kernels' fp32 tiles instead of a pass over the written
    gradients (on gem-large that pass read 0.8 GB a layer). Each tile's sums go to its own row of a buffer, summed
    once after (deterministic, no atomics). Needs as many K/V heads as query heads (a packed QKV projection)."""
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"column sums need as many k / v heads as q heads, got {q.shape[1]} and {k.shape[1]}")
    return _backward(dout, q, k, v, out, lse, pb, grads, column_sums=True)


def _backward(dout, q, k, v, out, lse, pb: Problem, grads, column_sums: bool):
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    total, heads, head_dim = q.shape
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    if total == 0 or pb.sched.query_tiles[_SMALL].shape[0] == 0:
        return dq, dk, dv, q.new_zeros((3, heads, head_dim), dtype=torch.float32) if column_sums else None
    # [small tiles, 3, H, D]: every row written by the kernels (see _store_column_sums); a dummy when unused
    sums = (torch.empty((pb.sched.num_small_tiles, 3, heads, head_dim), device=q.device, dtype=torch.float32)
            if column_sums else lse)  # fmt: skip
    sum_args = (sums, pb.sched.small_tile_starts)
    dout, out = last_dim_contiguous(dout), last_dim_contiguous(out)
    delta = torch.empty_like(lse)  # written by the dQ pass, read by the dK/dV pass
    common = dict(total_tokens=total, scale=pb.scale, scale_log2=pb.scale * LOG2E, **pb.runtime(), **pb.constexprs(q, k))
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    query_items = pb.sched.query_tiles
    descs, use_tma = _descriptors("dq", q, k, v, out, dout)
    _dq_kernel[_grid(query_items, heads, "BLOCK_M")](
        q, k, v, out, dout, lse, delta, dq, pb.offsets, pb.targets_arg(), query_items[_SMALL], query_items[_LARGE],
        *descs, *sum_args,
        *strides, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
        heads=heads, **common, USE_TMA=use_tma, COLUMN_SUMS=column_sums,
    )  # fmt: skip
    key_items = pb.sched.key_tiles
    descs, use_tma = _descriptors("dkdv", q, dout)
    _dkdv_kernel[_grid(key_items, k.shape[1], "BLOCK_N")](
        q, k, v, dout, lse, delta, dk, dv, pb.offsets, pb.targets_arg(), key_items[_SMALL], key_items[_LARGE], *descs,
        *sum_args,
        *strides, dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        heads=k.shape[1], **common, USE_TMA=use_tma, COLUMN_SUMS=column_sums,
    )  # fmt: skip
    return dq, dk, dv, sums.sum(0) if column_sums else None
