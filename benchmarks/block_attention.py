"""BlockAttention benchmark (issue 5): ours vs SDPA on padded blocks, SDPA-nested (flash varlen) on
blocks, FlexAttention with a block-diagonal + document mask, and JFA with a window, side by side.

Workloads (GEM_SPEC section 9): B = 1152 at Lmax 2000, sparsity 0.7; power-law lengths 100..16384
(~150k tokens). H = 4, D = 128, bf16, block 64. Reports ms, TFLOP/s (useful FLOPs: 4 H D pairs forward,
2.5x backward), achieved bandwidth and its fraction of the device-to-device copy bandwidth measured in
the same run. Bytes: forward reads q, k, v and writes o once; backward reads q, k, v, do and writes
dq, dk, dv once (the kernel recomputes P; o is not read).

Run: ``PYTHONPATH=src python -m benchmarks.block_attention [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.common import (
    bench_ms,
    offsets_of,
    power_law_lengths,
    print_table,
    relative_error,
    sparsity_lengths,
    write_results,
)
from opengem.ops.block_attention import Rotary, block_attention_from_hidden, block_pairs
from opengem.ops.reference import block_attention as reference
from opengem.ops.reference.rotary import apply_rotary, time_phase

HEADS, HEAD_DIM, D_MODEL = 4, 128, 512
DTYPE = torch.bfloat16
DEVICE = "cuda"  # the smoke test of this module swaps in "cpu"
CHECK_SEQUENCES = 24  # correctness is checked on the first sequences (the fp32 reference loops per block)


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy: bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def workloads() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    chosen = [("sparsity0.7_B1152_L2000", sparsity_lengths(1152, 2000, 0.7, g))]
    chosen.append(("power_law_100_16384", power_law_lengths(150_000, 100, 16384, g)))
    return chosen


def _op(q, k, v, offsets, block_size, rotary_mode, rotary_values, time_scale=1.0):
    """The custom op as a compiled model runs it (host validation, which syncs, is skipped there)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.opengem.block_attention_fwd(
        q, k, v, offsets, block_size, scale, "softmax", rotary_mode, rotary_values, 10000.0, time_scale, "auto"
    )


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
    at most three kv tiles), since create_block_mask over T x T does not fit at these sizes."""
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
    counts = (hi - lo + 1).to(torch.int32)

    padded_id = F.pad(block_id, (0, tile), value=-1)  # the kernel may evaluate the mask past the end

    def mask_mod(b, h, q_idx, kv_idx):
        return padded_id[q_idx] == padded_id[kv_idx]

    kv_blocks = (counts[None, None], indices.to(torch.int32)[None, None])
    try:
        return BlockMask.from_kv_blocks(*kv_blocks, BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(total, total))
    except TypeError:  # older signature without seq_lengths
        return BlockMask.from_kv_blocks(*kv_blocks, BLOCK_SIZE=tile, mask_mod=mask_mod)


def _host_ms(build: Callable[[], Any]) -> tuple[float, Any]:
    """Wall-clock milliseconds of a one-off build (host work and syncs included) and its result."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = build()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, result


def _timed(
    name: str, fwd: Callable[[], torch.Tensor], inputs, grad, flops: float, bytes_fwd: int | None, bytes_bwd: int | None,
    copy_gbps: float, **extra: Any,
) -> list[dict]:
    """Forward and backward rows; a failing backward (e.g. out of memory) still leaves the forward row."""

    def row(direction: str, ms: float, f: float, nbytes: int | None) -> dict:
        gbps = None if nbytes is None else nbytes / ms / 1e6
        frac = None if gbps is None else gbps / copy_gbps
        return dict(method=name, direction=direction, ms=ms, tflops=f / ms / 1e9, gbps=gbps, copy_frac=frac, **extra)

    rows = [row("fwd", bench_ms(fwd), flops, bytes_fwd)]
    try:
        out = fwd()
        bwd_ms = bench_ms(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True))
        rows.append(row("bwd", bwd_ms, 2.5 * flops, bytes_bwd))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        rows.append(dict(method=name, direction="bwd_error", error=repr(exc)[:200], **extra))
    return rows


def _error(name: str, got: torch.Tensor, want: torch.Tensor, rows: list[dict], workload: str) -> None:
    rows.append(dict(workload=workload, method=name, direction="check", rel_err=relative_error(got, want)))


def bench_workload(workload: str, lengths: torch.Tensor, copy_gbps: float, quick: bool, first: bool) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    block_size = 64
    offsets = offsets_of(lengths, DEVICE)
    total, max_len = int(lengths.sum()), int(lengths.max())
    make = lambda: torch.randn(total, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, requires_grad=True)  # noqa: E731
    q, k, v = make(), make(), make()
    grad = torch.randn(total, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    time_gaps = torch.rand(total, device=DEVICE) * 86400.0
    elem = q.element_size() * HEADS * HEAD_DIM * total
    bytes_fwd, bytes_bwd = 4 * elem, 7 * elem
    flops = 4 * HEADS * HEAD_DIM * block_pairs(offsets, block_size)
    common = dict(flops=flops, bytes_fwd=bytes_fwd, bytes_bwd=bytes_bwd, copy_gbps=copy_gbps, workload=workload, tokens=total)
    rows: list[dict[str, Any]] = []

    # Correctness on the first sequences against the fp32 reference (forward and all three gradients).
    n_check = int(lengths[:CHECK_SEQUENCES].sum())
    sub = [t[:n_check].detach().requires_grad_(True) for t in (q, k, v)]
    sub_offsets = offsets[: CHECK_SEQUENCES + 1]
    for label, mode, values in (("ours", 0, None), ("ours+time_rope", 3, time_gaps[:n_check])):
        ours = _op(*sub, sub_offsets, block_size, mode, values, time_scale=60.0)
        got = (ours, *torch.autograd.grad(ours, sub, grad[:n_check]))
        phase = None if mode == 0 else time_phase(values, 60.0)
        ref_in = [t.detach().float().requires_grad_(True) for t in sub]
        ref = reference.block_attention(*ref_in, sub_offsets, block_size=block_size, rotary_phase=phase)
        want = (ref, *torch.autograd.grad(ref, ref_in, grad[:n_check].float()))
        for part, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            _error(f"{label}:{part}", a, b, rows, workload)

    # Ours: rotary off, positional (in-sequence positions), time-aware.
    for label, mode, values in (("ours", 0, None), ("ours+pos_rope", 1, None), ("ours+time_rope", 3, time_gaps)):
        rows += _timed(label, lambda: _op(q, k, v, offsets, block_size, mode, values, 60.0), (q, k, v), grad, **common)
    if not quick:
        for bs in (32, 128):
            f = 4 * HEADS * HEAD_DIM * block_pairs(offsets, bs)
            rows += _timed(f"ours_block{bs}", lambda: _op(q, k, v, offsets, bs, 0, None), (q, k, v), grad, **{**common, "flops": f})
    reference_out = _op(q, k, v, offsets, block_size, 0, None).detach()

    # Peers.
    build_ms, layout = _host_ms(lambda: Layout(offsets, total, block_size))
    rows.append(dict(workload=workload, method="layout_build(host)", direction="setup", ms=build_ms))
    qp, kp, vp = (t.detach()[layout.gather].transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    mask = layout.key_valid[:, None, None, :]
    gradp = grad[layout.gather].transpose(1, 2).contiguous()
    peers: list[tuple[str, Callable[[], torch.Tensor], tuple, torch.Tensor]] = [
        ("sdpa_padded(+pad/unpad)", lambda: sdpa_padded(q, k, v, layout), (q, k, v), grad),
        ("sdpa_padded(core)", lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask), (qp, kp, vp), gradp),
        ("sdpa_nested(flash varlen)", lambda: sdpa_nested(q, k, v, layout), (q, k, v), grad),
    ]
    try:
        if quick and not first:
            raise RuntimeError("skipped in --quick (one flex compile per run)")
        from torch.nn.attention.flex_attention import flex_attention

        mask_ms, block_mask = _host_ms(lambda: flex_block_mask(layout, total))
        rows.append(dict(workload=workload, method="flex_block_mask_build", direction="setup", ms=mask_ms))
        flex = torch.compile(flex_attention, dynamic=False)
        as_bhtd = lambda t: t.transpose(0, 1)[None]  # noqa: E731
        peers.append(
            ("flex_block_diag", lambda: flex(as_bhtd(q), as_bhtd(k), as_bhtd(v), block_mask=block_mask)[0].transpose(0, 1), (q, k, v), grad)
        )
    except Exception as exc:  # noqa: BLE001 - a missing or failing peer is reported, not fatal
        rows.append(dict(workload=workload, method="flex_block_diag", direction="error", error=repr(exc)[:200]))
    try:
        from opengem.ops.jagged_attention import jagged_attention

        peers.append(
            ("jfa_causal_window64", lambda: jagged_attention(q, k, v, offsets, max_len, causal=True, window=block_size), (q, k, v), grad)
        )
    except Exception as exc:  # noqa: BLE001
        rows.append(dict(workload=workload, method="jfa_causal_window64", direction="error", error=repr(exc)[:200]))
    for name, fn, inputs, g in peers:
        try:
            if name != "sdpa_padded(core)" and not name.startswith("jfa"):
                _error(f"{name}:out_vs_ours", fn().detach(), reference_out, rows, workload)
            rows += _timed(name, fn, inputs, g, **common)
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(workload=workload, method=name, direction="error", error=repr(exc)[:200]))
        torch.cuda.empty_cache()

    rows += _fused_vs_unfused(offsets, max_len, total, time_gaps, block_size, common)
    _ratios(rows, workload)
    return rows


def _fused_vs_unfused(offsets, max_len, total, time_gaps, block_size, common) -> list[dict]:
    """Projection + time-aware RoPE + attention: rotary fused in the kernel vs a separate rotary op."""
    x = torch.randn(total, D_MODEL, device=DEVICE, dtype=DTYPE, requires_grad=True)
    w = (torch.randn(3 * HEADS * HEAD_DIM, D_MODEL, device=DEVICE, dtype=DTYPE) / D_MODEL**0.5).requires_grad_(True)
    grad = torch.randn(total, HEADS * HEAD_DIM, device=DEVICE, dtype=DTYPE)
    rotary = Rotary(time_gaps=time_gaps, time_scale=60.0)
    phase = time_phase(time_gaps, 60.0)

    def fused():
        return block_attention_from_hidden(x, w, offsets, max_len, HEADS, block_size=block_size, rotary=rotary)

    def unfused():
        q, k, v = F.linear(x, w).view(total, 3, HEADS, HEAD_DIM).unbind(1)
        q, k = (apply_rotary(t, phase, 10000.0).to(DTYPE) for t in (q, k))
        return _op(q, k, v, offsets, block_size, 0, None).view(total, HEADS * HEAD_DIM)

    gemm_flops = 2 * total * D_MODEL * 3 * HEADS * HEAD_DIM
    # Bytes are left out here: the GEMM's traffic is not the attention's memory-bound model.
    options = {**common, "flops": common["flops"] + gemm_flops, "bytes_fwd": None, "bytes_bwd": None}
    rows = _timed("from_hidden_fused_rope", fused, (x, w), grad, **options)
    rows += _timed("from_hidden_separate_rope", unfused, (x, w), grad, **options)
    return rows


def _ratios(rows: list[dict], workload: str) -> None:
    """speedup = best peer time / our time, per direction; rope_overhead = ours+rope / ours - 1."""
    peers = ("sdpa", "flex", "jfa")
    ours = ("ours", "ours+pos_rope", "ours+time_rope")
    for direction in ("fwd", "bwd"):
        timed = {r["method"]: r["ms"] for r in rows if r.get("direction") == direction and r.get("workload") == workload}
        best = min((t for m, t in timed.items() if m.startswith(peers)), default=None)
        for r in rows:
            if r.get("direction") == direction and r.get("workload") == workload and r["method"] in ours:
                r["speedup_vs_best_peer"] = best / r["ms"] if best else None
                if r["method"] in ("ours+pos_rope", "ours+time_rope"):
                    r["rope_overhead"] = r["ms"] / timed["ours"] - 1.0


def run(quick: bool) -> list[dict[str, Any]]:
    copy_gbps = copy_bandwidth_gbps()
    rows: list[dict[str, Any]] = [dict(workload="device", method="d2d_copy", direction="copy", gbps=copy_gbps)]
    for i, (name, lengths) in enumerate(workloads()):
        rows += bench_workload(name, lengths, copy_gbps, quick, first=i == 0)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="block 64 only, no block-size sweep, FlexAttention on the first workload only (< 90 s)")
    args = parser.parse_args()
    rows = run(args.quick)
    columns = ["workload", "method", "direction", "ms", "tflops", "gbps", "copy_frac", "speedup_vs_best_peer", "rope_overhead", "rel_err", "error"]
    print_table(rows, columns)
    bytes_note = "fwd bytes = (q + k + v + o), bwd bytes = (q + k + v + do + dq + dk + dv), each T*H*D*2 (bf16, H_kv = H)"
    path = write_results("block_attention", rows, extra={"bytes": bytes_note, "heads": HEADS, "head_dim": HEAD_DIM})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
