"""BlockAttention benchmark (issue 5): ours vs SDPA on padded blocks, SDPA-nested (flash varlen) on
blocks, FlexAttention with a block-diagonal + document mask, and JFA with a window, side by side.

Workloads (GEM_SPEC section 9): B = 1152 at Lmax 2000, sparsity 0.7; power-law lengths 100..16384
(~150k tokens). H = 4, D = 128, bf16, block 64. Reports ms, TFLOP/s (useful FLOPs: 4 H D pairs forward,
2.5x backward), achieved bandwidth and its percentage of the device-to-device copy bandwidth measured in
the same run. Bytes: forward reads q, k, v and writes o once; backward reads q, k, v, do and writes
dq, dk, dv once (the kernel recomputes P; o is not read). Peer rows carry ``vs_ours`` = peer time / our
time (> 1: ours faster).

Timing: every variant is timed twice, eagerly with CUDA events around repeated calls (``eager_ms``,
``do_bench``) and by replaying a CUDA graph of calls captured back to back (``bench_graph_ms``), after the
eager timing has warmed compiles, autotuning and host caches. ``ms`` is the replay figure where capture
worked, else the eager one; ``timing`` says which (a call that syncs cannot be captured; ``graph_error``
in the JSON says why). Why: small workloads are host-bound: on the power-law one (~150k tokens) our
forward's device work is ~0.15 ms but an eager call took ~0.37 ms (checks, custom-op dispatch, autotuner
launch), so eager figures there time the host. TFLOP/s, GB/s and copy_pct use ``ms``; a ratio (``vs_ours``, ``rope_overhead``,
``speedup_vs_best_peer``) divides replay by replay figures, or eager by eager where either row has none.
Replays do not flush the L2 between calls (do_bench does); each workload's tensors are larger than the 60 MB
L2. The backward is timed off a forward run on a side stream: backward ops run on their forward's stream,
and the legacy default stream cannot take part in a capture.

Order: our kernels first, then the copy bandwidth, the SDPA peers, and last JFA and FlexAttention (a
compiled peer's CUDA error poisons the context; it must not cost our numbers). Each finished row is
printed and ``benchmarks/results/block_attention.json`` rewritten at once, so a run cut short keeps every
number it finished; every variant ends with a device sync so an asynchronous error is charged to it.
Correctness: ours (and the SDPA peers' forward) against the fp32 reference on the first
CHECK_SEQUENCES sequences, sliced out of the full-batch run (blocks are independent).

Run: ``PYTHONPATH=src python -m benchmarks.block_attention [--quick]``. ``--quick`` (< 80 s cold): the
sparsity workload, ours with rotary off, positional and time-aware rotary (``rope_overhead`` = time with
rotary / time without - 1), the copy bandwidth, padded and nested SDPA; one pinned kernel config (no
autotuning), no Flex, no JFA, no block-size sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.common import (
    bench_graph_ms,
    bench_ms,
    offsets_of,
    power_law_lengths,
    print_table,
    relative_error,
    sparsity_lengths,
    write_results,
)
from opengem.ops.block_attention import Rotary, block_attention, block_attention_from_hidden, block_pairs
from opengem.ops.reference import block_attention as reference
from opengem.ops.reference.rotary import apply_rotary, positions_in_sequence, time_phase

HEADS, HEAD_DIM, D_MODEL = 4, 128, 512
BLOCK_SIZE = 64
TIME_SCALE = 60.0
DTYPE = torch.bfloat16
DEVICE = "cuda"  # the smoke test of this module swaps in "cpu"
CHECK_SEQUENCES = 8  # correctness is checked on the first sequences (the fp32 reference loops per block)
# (label, rotary mode): 0 off, 1 in-sequence positions, 2 given positions, 3 time gaps
# (opengem.ops.block_attention.ROTARY_*)
OURS = (("ours", 0), ("ours+pos_rope", 1), ("ours+time_rope", 3), ("ours+given_pos_rope", 2))
QUICK_OURS = OURS[:3]
COLUMNS = ["workload", "method", "direction", "ms", "timing", "eager_ms", "tflops", "gbps", "copy_pct", "vs_ours",
           "speedup_vs_best_peer", "rope_overhead", "rel_err", "error"]


def _sync() -> None:
    """Wait for the device, so an asynchronous error surfaces in the variant that caused it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pin_default_configs() -> None:
    """``--quick``: one config per kernel, which makes Triton skip autotuning (no timing, one compile per
    variant): 4 warps for both, the configs the autotuner picks at block 64, D 128 on an H200 (backward:
    4 warps 3.78 ms against 5.52 at 8 warps, session 6). The GPU tests run every config for correctness."""
    from opengem.ops.triton import block_attention as kernels

    for kernel in (kernels._block_attention_fwd, kernels._block_attention_bwd):
        kernel.configs = [
            c for c in kernel.configs
            if c.num_warps == 4 and c.maxnreg is None and not c.kwargs.get("SHARE_BACK") and not c.kwargs.get("LATE_V")
        ] or kernel.configs[:1]  # fmt: skip


def print_tuned_configs() -> None:
    """The config the autotuner picked per key (BLOCK, HALF, GROUP, ACT, ROT, REDUCE) of each kernel."""
    from opengem.ops.triton import block_attention as kernels

    for name, kernel in (("fwd", kernels._block_attention_fwd), ("bwd", kernels._block_attention_bwd)):
        for key, config in kernel.cache.items():
            print(f"tuned {name} {key[:6]}: {config}", flush=True)


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy: bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    _sync()
    return 2 * nbytes / ms / 1e6


def workloads(quick: bool) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    chosen = [("sparsity0.7_B1152_L2000", sparsity_lengths(1152, 2000, 0.7, g))]
    if not quick:
        chosen.append(("power_law_100_16384", power_law_lengths(150_000, 100, 16384, g)))
    return chosen


def _op(q, k, v, offsets, block_size, rotary_mode, rotary_values, time_scale=TIME_SCALE):
    """The custom op as a compiled model runs it (host validation, which syncs, is skipped there)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.opengem.block_attention_fwd(
        q, k, v, offsets, block_size, scale, "softmax", rotary_mode, rotary_values, 10000.0, time_scale, "auto"
    )


@dataclass
class Batch:
    """One workload's inputs on the device (same seed every time it is built) and its work counts."""

    name: str
    lengths: torch.Tensor
    offsets: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad: torch.Tensor
    time_gaps: torch.Tensor
    positions: torch.Tensor  # in-sequence positions handed to the kernel as given positions (mode 2)
    flops: int  # forward, block 64
    bytes_fwd: int
    bytes_bwd: int

    @property
    def total(self) -> int:
        return self.q.shape[0]

    @property
    def max_len(self) -> int:
        return int(self.lengths.max())

    def rotary_values(self, mode: int) -> torch.Tensor | None:
        return {2: self.positions, 3: self.time_gaps}.get(mode)


def make_batch(name: str, lengths: torch.Tensor) -> Batch:
    torch.manual_seed(0)
    offsets = offsets_of(lengths, DEVICE)
    total = int(lengths.sum())
    make = lambda: torch.randn(total, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, requires_grad=True)  # noqa: E731
    q, k, v = make(), make(), make()
    grad = torch.randn(total, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    elem = q.element_size() * HEADS * HEAD_DIM * total
    flops = 4 * HEADS * HEAD_DIM * block_pairs(offsets, BLOCK_SIZE)
    time_gaps = torch.rand(total, device=DEVICE) * 86400.0
    positions = positions_in_sequence(offsets, total).float()
    return Batch(name, lengths, offsets, q, k, v, grad, time_gaps, positions, flops, 4 * elem, 7 * elem)


class Results:
    """The rows so far: each new row is printed on one line and the JSON rewritten at once, so a run
    killed by a timeout still leaves every finished number behind."""

    def __init__(self, quick: bool) -> None:
        self.rows: list[dict[str, Any]] = []
        self.quick = quick
        self.start = time.time()
        self.copy_gbps: float | None = None

    def add(self, row: dict[str, Any]) -> None:
        row["elapsed_s"] = round(time.time() - self.start, 1)
        self._fill_copy_pct(row)
        self.rows.append(row)
        self.write()
        print(" | ".join(f"{c}={_short(row[c])}" for c in [*COLUMNS, "elapsed_s"] if row.get(c) is not None),
              flush=True)

    def set_copy_bandwidth(self, gbps: float) -> None:
        """Record the copy bandwidth and express every earlier row's bandwidth as a percentage of it."""
        self.copy_gbps = gbps
        for row in self.rows:
            self._fill_copy_pct(row)
        self.add(dict(workload="device", method="d2d_copy", direction="copy", gbps=gbps))

    def ours(self, workload: str, direction: str, method: str = "ours") -> dict[str, Any] | None:
        return next((r for r in self.rows if (r["workload"], r["method"], r["direction"]) == (workload, method, direction)), None)

    def write(self) -> None:
        bytes_note = "fwd bytes = (q + k + v + o), bwd bytes = (q + k + v + do + dq + dk + dv), each T*H*D*2 (bf16, H_kv = H)"
        write_results("block_attention", self.rows, extra={"quick": self.quick, "bytes": bytes_note, "heads": HEADS,
                                                           "head_dim": HEAD_DIM, "copy_gbps": self.copy_gbps})

    def _fill_copy_pct(self, row: dict[str, Any]) -> None:
        if self.copy_gbps and row.get("gbps") is not None and row.get("direction") != "copy":
            row["copy_pct"] = 100 * row["gbps"] / self.copy_gbps


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Layout:
    """Block geometry of one batch, built once (its build time is reported separately)."""

    def __init__(self, offsets: torch.Tensor, total: int, block_size: int) -> None:
        host = offsets.cpu().long()
        lengths = host[1:] - host[:-1]
        blocks = torch.tensor(
            [min(block_size, int(n) - s) for n in lengths for s in range(0, int(n), block_size)], dtype=torch.long
        )
        device = offsets.device
        self.num_blocks = blocks.numel()
        self.block_offsets = offsets_of(blocks, device)
        starts = self.block_offsets[:-1].long()
        cols = torch.arange(block_size, device=device)
        self.key_valid = cols[None, :] < blocks.to(device)[:, None]  # [NB, bs]
        self.gather = (starts[:, None] + cols[None, :]).clamp(max=max(total - 1, 0))  # [NB, bs]
        self.scatter = torch.nonzero(self.key_valid.flatten()).flatten()  # padded slot of each token
        self.block_id = torch.repeat_interleave(torch.arange(self.num_blocks, device=device), blocks.to(device))
        self.block_size = block_size


def sdpa_padded(q, k, v, layout: Layout) -> torch.Tensor:
    """Gather blocks into [NB, H, bs, D], SDPA with a key-padding mask, scatter valid rows back."""
    pad = lambda t: t[layout.gather].transpose(1, 2)  # noqa: E731
    mask = layout.key_valid[:, None, None, :]
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask)
    return out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])[layout.scatter]


def sdpa_nested(q, k, v, layout: Layout) -> torch.Tensor:
    """Each block as one sequence of a jagged nested tensor: SDPA dispatches to varlen flash."""
    nest = lambda t: torch.nested.nested_tensor_from_jagged(  # noqa: E731
        t, layout.block_offsets.long(), max_seqlen=layout.block_size
    ).transpose(1, 2)
    return F.scaled_dot_product_attention(nest(q), nest(k), nest(v)).transpose(1, 2).values()


def flex_block_mask(layout: Layout, total: int):
    """Block-diagonal + document BlockMask built directly from kv-tile lists (each 128-token q tile meets
    at most three kv tiles), since create_block_mask over T x T does not fit at these sizes.

    The q-tile lists (backward) are handed in rather than derived: ``from_kv_blocks`` transposes through
    a dense [q_tiles, kv_indices.shape[-1]] mask, which with 3-wide lists indexes out of bounds (a device
    assert on the GPU), and padding the lists to full width would cost q_tiles^2 int32 (~0.6 GB each at
    1.6M tokens). The mask is symmetric (two tokens of one block), so the q lists equal the kv lists."""
    from torch.nn.attention.flex_attention import BlockMask

    tile = 128
    block_id = layout.block_id
    q_tiles = (total + tile - 1) // tile
    first_tok = torch.arange(q_tiles, device=block_id.device) * tile
    last_tok = (first_tok + tile - 1).clamp(max=total - 1)
    starts = layout.block_offsets.long()
    lo = starts[block_id[first_tok]] // tile
    hi = (starts[block_id[last_tok] + 1] - 1) // tile
    indices = (lo[:, None] + torch.arange(3, device=lo.device)[None, :]).clamp(max=q_tiles - 1)
    counts = (hi - lo + 1).to(torch.int32)[None, None]
    indices = indices.to(torch.int32)[None, None]

    padded_id = F.pad(block_id, (0, tile), value=-1)  # the kernel may evaluate the mask past the end

    def mask_mod(b, h, q_idx, kv_idx):
        return padded_id[q_idx] == padded_id[kv_idx]

    # By keyword: the same names in torch 2.11 and 2.13 (2.13 adds keyword-only extras after them).
    return BlockMask(
        seq_lengths=(total, total), kv_num_blocks=counts, kv_indices=indices, full_kv_num_blocks=None,
        full_kv_indices=None, q_num_blocks=counts, q_indices=indices, full_q_num_blocks=None, full_q_indices=None,
        BLOCK_SIZE=(tile, tile), mask_mod=mask_mod,
    )  # fmt: skip


def _host_ms(build: Callable[[], Any]) -> tuple[float, Any]:
    """Wall-clock milliseconds of a one-off build (host work and syncs included) and its result."""
    _sync()
    start = time.perf_counter()
    result = build()
    _sync()
    return (time.perf_counter() - start) * 1e3, result


def _error_row(workload: str, method: str, direction: str, exc: BaseException) -> dict[str, Any]:
    """A failed variant's row; the device is synced and its cache freed for the next variant."""
    try:
        _sync()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a poisoned context fails here too; the row already says why
        pass
    return dict(workload=workload, method=method, direction=direction, error=f"{type(exc).__name__}: {exc}"[:200])


def _like_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """a's time / b's time, both timed the same way: graph replay where both rows have it, else eager."""
    return a["ms"] / b["ms"] if a["timing"] == b["timing"] else a["eager_ms"] / b["eager_ms"]


def _stream() -> contextlib.AbstractContextManager:
    """A side stream on the GPU: backward ops run on their forward's stream, and the legacy default stream
    cannot join a capture, so a forward whose backward is graph-timed must not run there."""
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(stream)


def _timed(
    results: Results, b: Batch, name: str, fwd: Callable[[], torch.Tensor], inputs: tuple, grad: torch.Tensor,
    flops: int | None = None, with_bytes: bool = True,
) -> None:
    """Forward, then backward row (each added when measured); a failing backward keeps the forward row.
    Each is timed eagerly (``eager_ms``; the first call inside ``bench_ms``, compiles included, is not
    timed), then by graph replay, which needs the warm caches the eager timing leaves; ``ms`` is the
    replay figure where capture worked (``timing`` says which)."""
    flops = b.flops if flops is None else flops

    def row(direction: str, eager_ms: float, graph_ms: float | None, graph_error: list[str], f: float,
            nbytes: int) -> dict:
        ms = eager_ms if graph_ms is None else graph_ms
        gbps = nbytes / ms / 1e6 if with_bytes else None
        out = dict(workload=b.name, method=name, direction=direction, ms=ms, eager_ms=eager_ms,
                   timing="eager" if graph_ms is None else "graph", tflops=f / ms / 1e9, gbps=gbps)
        if graph_error:
            out["graph_error"] = graph_error[-1]  # why there is no replay figure (JSON only)
        ours = results.ours(b.name, direction)
        if ours is not None and name.startswith(("sdpa", "flex", "jfa")):
            out["vs_ours"] = _like_ratio(out, ours)
        if ours is not None and name.startswith("ours+"):
            out["rope_overhead"] = _like_ratio(out, ours) - 1.0
        return out

    for direction in ("fwd", "bwd"):
        declined: list[str] = []
        try:
            with _stream():
                if direction == "fwd":
                    fn = fwd
                else:
                    out = fwd()
                    fn = lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)
                eager_ms = bench_ms(fn)
                _sync()
                graph_ms = bench_graph_ms(fn, on_error=declined.append)
                _sync()
            fn = out = None  # frees the saved activations before the next variant
        except Exception as exc:  # noqa: BLE001 - reported in the table
            results.add(_error_row(b.name, name, f"{direction}_error", exc))
            return
        nbytes = b.bytes_fwd if direction == "fwd" else b.bytes_bwd
        results.add(row(direction, eager_ms, graph_ms, declined, flops if direction == "fwd" else 2.5 * flops, nbytes))


def check_ours(results: Results, b: Batch, label: str, mode: int) -> None:
    """Out, dq, dk, dv of the full-batch run on the first CHECK_SEQUENCES sequences vs the fp32 reference."""
    try:
        n = int(b.lengths[:CHECK_SEQUENCES].sum())
        sub_offsets = b.offsets[: CHECK_SEQUENCES + 1]
        values = b.rotary_values(mode)
        out = _op(b.q, b.k, b.v, b.offsets, BLOCK_SIZE, mode, values)
        got = [t[:n].detach() for t in (out, *torch.autograd.grad(out, (b.q, b.k, b.v), b.grad))]
        phase = None
        if mode == 1:
            phase = positions_in_sequence(sub_offsets, n).float()
        elif mode == 2:
            phase = values[:n]
        elif mode == 3:
            phase = time_phase(values[:n], TIME_SCALE)
        ref_in = [t[:n].detach().float().requires_grad_(True) for t in (b.q, b.k, b.v)]
        ref = reference.block_attention(*ref_in, sub_offsets, block_size=BLOCK_SIZE, rotary_phase=phase)
        want = (ref, *torch.autograd.grad(ref, ref_in, b.grad[:n].float()))
        errors = [relative_error(a, w) for a, w in zip(got, want)]
        _sync()
    except Exception as exc:  # noqa: BLE001
        results.add(_error_row(b.name, f"{label}:check", "error", exc))
        return
    for part, err in zip(("out", "dq", "dk", "dv"), errors):
        results.add(dict(workload=b.name, method=f"{label}:{part}", direction="check", rel_err=err))


def bench_ours(results: Results, b: Batch, quick: bool) -> None:
    for label, mode in QUICK_OURS if quick else OURS:
        values = b.rotary_values(mode)
        _timed(results, b, label, lambda: _op(b.q, b.k, b.v, b.offsets, BLOCK_SIZE, mode, values), (b.q, b.k, b.v), b.grad)
        check_ours(results, b, label, mode)
    if quick:
        return
    for bs in (32, 128):
        flops = 4 * HEADS * HEAD_DIM * block_pairs(b.offsets, bs)
        _timed(results, b, f"ours_block{bs}", lambda: _op(b.q, b.k, b.v, b.offsets, bs, 0, None), (b.q, b.k, b.v),
               b.grad, flops=flops)
    _fused_vs_unfused(results, b)


def bench_sdpa(results: Results, b: Batch) -> None:
    """SDPA on padded blocks (with and without the pad/unpad gathers) and on nested (varlen) blocks."""
    reference_out = _op(b.q, b.k, b.v, b.offsets, BLOCK_SIZE, 0, None).detach()
    build_ms, layout = _host_ms(lambda: Layout(b.offsets, b.total, BLOCK_SIZE))
    results.add(dict(workload=b.name, method="layout_build(host)", direction="setup", ms=build_ms, timing="host"))
    q, k, v = b.q, b.k, b.v
    qp, kp, vp = (t.detach()[layout.gather].transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    mask = layout.key_valid[:, None, None, :]
    gradp = b.grad[layout.gather].transpose(1, 2).contiguous()
    peers = [
        ("sdpa_padded(+pad/unpad)", lambda: sdpa_padded(q, k, v, layout), (q, k, v), b.grad, True),
        ("sdpa_padded(core)", lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask), (qp, kp, vp), gradp, False),
        ("sdpa_nested(flash varlen)", lambda: sdpa_nested(q, k, v, layout), (q, k, v), b.grad, True),
    ]
    for name, fn, inputs, grad, comparable in peers:
        _run_peer(results, b, name, fn, inputs, grad, reference_out if comparable else None)


def _run_peer(results: Results, b: Batch, name: str, fn: Callable[[], torch.Tensor], inputs: tuple,
              grad: torch.Tensor, reference_out: torch.Tensor | None) -> None:
    """Optional forward check against our output, then the timed rows; failures become rows."""
    if reference_out is not None:
        try:
            err = relative_error(fn().detach(), reference_out)
            _sync()
            results.add(dict(workload=b.name, method=f"{name}:out_vs_ours", direction="check", rel_err=err))
        except Exception as exc:  # noqa: BLE001
            results.add(_error_row(b.name, name, "error", exc))
            return
    _timed(results, b, name, fn, inputs, grad)
    torch.cuda.empty_cache()


def bench_jfa(results: Results, b: Batch) -> None:
    try:
        from opengem.ops.jagged_attention import jagged_attention
    except ImportError as exc:
        results.add(_error_row(b.name, "jfa_causal_window64", "error", exc))
        return
    fn = lambda: jagged_attention(b.q, b.k, b.v, b.offsets, b.max_len, causal=True, window=BLOCK_SIZE)  # noqa: E731
    _run_peer(results, b, "jfa_causal_window64", fn, (b.q, b.k, b.v), b.grad, None)


def bench_fp8(results: Results, b: Batch) -> None:
    """Ours with ``precision="fp8"`` (the blocks as sequences of their own through the FP8 JFA), its output
    against ours in bf16 (FP8's error, ~5e-2), then its timed rows."""
    fn = lambda: block_attention(b.q, b.k, b.v, b.offsets, b.max_len, block_size=BLOCK_SIZE, precision="fp8")  # noqa: E731
    reference_out = _op(b.q, b.k, b.v, b.offsets, BLOCK_SIZE, 0, None).detach()
    _run_peer(results, b, "ours_fp8", fn, (b.q, b.k, b.v), b.grad, reference_out)


def bench_flex(results: Results, b: Batch) -> None:
    try:
        from torch.nn.attention.flex_attention import flex_attention

        layout = Layout(b.offsets, b.total, BLOCK_SIZE)
        mask_ms, block_mask = _host_ms(lambda: flex_block_mask(layout, b.total))
        results.add(dict(workload=b.name, method="flex_block_mask_build", direction="setup", ms=mask_ms, timing="host"))
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as exc:  # noqa: BLE001 - a missing or failing peer is reported, not fatal
        results.add(_error_row(b.name, "flex_block_diag", "error", exc))
        return
    as_bhtd = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    fn = lambda: flex(as_bhtd(b.q), as_bhtd(b.k), as_bhtd(b.v), block_mask=block_mask)[0].transpose(0, 1)  # noqa: E731
    reference_out = _op(b.q, b.k, b.v, b.offsets, BLOCK_SIZE, 0, None).detach()
    _run_peer(results, b, "flex_block_diag", fn, (b.q, b.k, b.v), b.grad, reference_out)


def _fused_vs_unfused(results: Results, b: Batch) -> None:
    """Projection + time-aware RoPE + attention: rotary fused in the kernel vs a separate rotary op."""
    total = b.total
    x = torch.randn(total, D_MODEL, device=DEVICE, dtype=DTYPE, requires_grad=True)
    w = (torch.randn(3 * HEADS * HEAD_DIM, D_MODEL, device=DEVICE, dtype=DTYPE) / D_MODEL**0.5).requires_grad_(True)
    grad = torch.randn(total, HEADS * HEAD_DIM, device=DEVICE, dtype=DTYPE)
    rotary = Rotary(time_gaps=b.time_gaps, time_scale=TIME_SCALE)
    phase = time_phase(b.time_gaps, TIME_SCALE)

    def fused():
        return block_attention_from_hidden(x, w, b.offsets, b.max_len, HEADS, block_size=BLOCK_SIZE, rotary=rotary)

    def unfused():
        q, k, v = F.linear(x, w).view(total, 3, HEADS, HEAD_DIM).unbind(1)
        q, k = (apply_rotary(t, phase, 10000.0).to(DTYPE) for t in (q, k))
        return _op(q, k, v, b.offsets, BLOCK_SIZE, 0, None).view(total, HEADS * HEAD_DIM)

    # Bytes are left out here: the GEMM's traffic is not the attention's memory-bound model.
    flops = b.flops + 2 * total * D_MODEL * 3 * HEADS * HEAD_DIM
    _timed(results, b, "from_hidden_fused_rope", fused, (x, w), grad, flops=flops, with_bytes=False)
    _timed(results, b, "from_hidden_separate_rope", unfused, (x, w), grad, flops=flops, with_bytes=False)


def _ratios(rows: list[dict], workload: str) -> None:
    """speedup_vs_best_peer = best peer time / our time, per direction, each pair timed alike."""
    for direction in ("fwd", "bwd"):
        timed = [r for r in rows if r.get("direction") == direction and r.get("workload") == workload]
        peers = [r for r in timed if r["method"].startswith(("sdpa", "flex", "jfa"))]
        for r in timed:
            if r["method"] in dict(OURS) and peers:
                r["speedup_vs_best_peer"] = min(_like_ratio(p, r) for p in peers)


def run(quick: bool) -> list[dict[str, Any]]:
    """Our kernels on every workload, the copy bandwidth, the SDPA peers, then (full run) JFA and Flex."""
    results = Results(quick)
    if quick:
        pin_default_configs()
    chosen = workloads(quick)

    def on_each_workload(bench: Callable[[Batch], None]) -> None:
        for name, lengths in chosen:
            b = make_batch(name, lengths)
            bench(b)
            del b
            torch.cuda.empty_cache()

    on_each_workload(lambda b: bench_ours(results, b, quick))
    print_tuned_configs()
    try:
        results.set_copy_bandwidth(copy_bandwidth_gbps())
    except Exception as exc:  # noqa: BLE001
        results.add(_error_row("device", "d2d_copy", "error", exc))
    for peers in [bench_sdpa, bench_fp8] if quick else [bench_sdpa, bench_fp8, bench_jfa, bench_flex]:  # compiled last
        on_each_workload(lambda b: peers(results, b))
    for name, _ in chosen:
        _ratios(results.rows, name)
    results.write()
    return results.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="sparsity workload, ours (rotary off/positional/time), copy, SDPA peers; no autotuning (< 80 s)")
    rows = run(parser.parse_args().quick)
    print_table(rows, COLUMNS)
    print("vs_ours = peer time / our time (> 1: ours faster); copy_pct = achieved GB/s as % of the d2d copy; "
          "ms = graph replay where timing = graph, else eager_ms; ratios compare figures timed alike")


if __name__ == "__main__":
    main()
