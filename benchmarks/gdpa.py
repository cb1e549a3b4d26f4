"""GDPA benchmark (issue 4 workloads a-d): our Triton kernel vs our JFA (softmax, self-attention shapes),
the padded reference (eager and compiled) and FlexAttention (softmax, speed reference only), bf16.

TFLOP/s count useful FLOPs only (GEM_SPEC section 8): forward 4 H D x visible pairs, backward 2.5x.
Padded peers get pre-padded inputs (padding/unpadding not timed, in their favour) and run on a sub-batch
that fits (never [B, H, L, L] at full size); their times scale linearly with the batch, so they are
scaled to the full batch and marked so. Errors are relative errors of the output and of dq/dk/dv against
the fp32 reference on the first ERROR_SAMPLES samples.

Order: our kernel on every workload first, then JFA, the eager padded peer, and last the risky ones
(torch.compile, FlexAttention): a CUDA error poisons the context, so it must not cost our numbers. Each
finished row is printed and rewritten to ``benchmarks/results/gdpa.json`` at once, so a run cut short
keeps every number it finished; every variant ends with a device sync so an asynchronous error is
charged to the variant that caused it.

Run: ``PYTHONPATH=src python -m benchmarks.gdpa [--quick]``. ``--quick`` (< 75 s cold): (a) L=1024
sparsity 1.0 and (b) KV=256, default kernel configurations (``OPENGEM_GDPA_TUNE=0`` and
``OPENGEM_JFA_AUTOTUNE=0``: no tuning compiles), JFA on (a), the eager padded peer on 64 samples; no
torch.compile, no FlexAttention. The full run covers (a)-(d) with tuning and every peer. ``--workloads
"a self L=1024,b "``: the workloads whose names start so; ``--peers jfa,padded-compiled``: only these peers.
The JSON's ``tuning`` lists every tuned key's candidates (tile shape and load path) with their milliseconds.
Against JFA the forward is also timed interleaved with ours (``x_fwd_paired``, checked beside ``x_fwd``), and so
again from CUDA-graph replays (``x_fwd_graph``: device time, where host time decides the op's figure).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from benchmarks.common import (
    bench_graph_ms,
    bench_ms,
    by_name_prefix,
    interleaved_ms,
    offsets_of,
    paired_speedup,
    power_law_lengths,
    print_table,
    relative_error,
    sparsity_lengths,
    write_results,
)
from opengem.ops.activations import activation_value
from opengem.ops.attention_flops import attention_flops, visible_pairs
from opengem.ops.gdpa import gdpa
from opengem.ops.reference import gdpa as reference
from opengem.ops.triton import gdpa as triton_gdpa

HEADS, HEAD_DIM, BATCH = 4, 128, 1152
PADDED_BUDGET_BYTES = 40 * 2**30  # scores, activation and their grads of the padded peers
PADDED_BYTES_PER_SCORE = 16  # bf16 + fp32 scores, fp32 activation, bf16 weights, saved for backward
ERROR_SAMPLES = 8
PEERS = ("jfa", "padded-eager", "padded-compiled", "flex(softmax)")  # safest first: compiled and Flex last
QUICK_SKIPS = {"padded-compiled": "skipped in --quick (torch.compile time)",
               "flex(softmax)": "skipped in --quick (compile time)"}
QUICK_PADDED_SAMPLES = 64  # --quick times the eager padded peer on this many samples, scaled to the batch
# The forward against JFA is also timed interleaved (GDPA and JFA alternating, ``PAIRED_ROUNDS`` rounds, median of
# the per-round ratios): timed apart (ours first on every workload, peers after), the ratio moved 1.089-1.193x between
# two runs of one workload (session 23), a spread as large as the 1.1x bar's margin.
PAIRED_ROUNDS = 7


@dataclass
class Workload:
    name: str
    q_lengths: torch.Tensor  # [B]; for broadcast, every entry is the number of seeds
    k_lengths: torch.Tensor
    activation: str
    broadcast_q: bool = False
    causal: bool = False
    num_targets: torch.Tensor | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def self_attention(self) -> bool:
        return not self.broadcast_q and torch.equal(self.q_lengths, self.k_lengths)


def workloads(quick: bool) -> list[Workload]:
    gen = torch.Generator().manual_seed(0)
    out: list[Workload] = []
    self_shapes = [(1024, 1.0)] if quick else [(n, s) for n in (256, 512, 1024, 2048) for s in (0.5, 1.0)]
    for max_len, sparsity in self_shapes:
        lengths = sparsity_lengths(BATCH, max_len, sparsity, gen)
        out.append(Workload(f"a self L={max_len} s={sparsity}", lengths, lengths, "fast_gelu"))
    for kv in (256,) if quick else (128, 256):
        q_lengths = sparsity_lengths(BATCH, 2048, 0.5, gen)
        out.append(Workload(f"b cross Q<=2048 KV={kv}", q_lengths, torch.full((BATCH,), kv), "fast_gelu"))
    if quick:
        return out
    for seeds in (32, 128):
        k_lengths = sparsity_lengths(BATCH, 4096, 0.5, gen)
        out.append(Workload(f"c pool seeds={seeds} KV<=4096", torch.full((BATCH,), seeds), k_lengths, "fast_gelu",
                            broadcast_q=True))
    lengths = power_law_lengths(300_000, 100, 8192, gen)
    targets = torch.clamp(lengths, max=64)
    out.append(Workload("d hstu causal+64 targets", lengths, lengths, "silu", causal=True, num_targets=targets))
    return out


def workload_flops(w: Workload) -> tuple[float, float]:
    """Useful (forward, backward) FLOPs of ``w`` (GEM_SPEC section 8: its visible pairs only)."""
    q_lengths = w.q_lengths if not w.broadcast_q else torch.full_like(w.k_lengths, int(w.q_lengths[0]))
    pairs = visible_pairs(q_lengths, w.k_lengths, masked=w.causal, causal=w.causal, num_targets=w.num_targets)
    return attention_flops(pairs, HEADS, HEAD_DIM)


def _tensors(w: Workload, device: str) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(1)
    q_rows = int(w.q_lengths[0]) if w.broadcast_q else int(w.q_lengths.sum())
    k_rows = int(w.k_lengths.sum())

    def rand(rows: int) -> torch.Tensor:
        return torch.randn(rows, HEADS, HEAD_DIM, generator=gen, device=device).bfloat16().requires_grad_(True)

    return dict(
        q=rand(q_rows), k=rand(k_rows), v=rand(k_rows),
        q_offsets=None if w.broadcast_q else offsets_of(w.q_lengths, device),
        k_offsets=offsets_of(w.k_lengths, device),
        max_len_q=int(w.q_lengths.max()), max_len_k=int(w.k_lengths.max()),
        num_targets=None if w.num_targets is None else w.num_targets.to(device),
    )


def _ours(w: Workload, t: dict[str, Any]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        return gdpa(t["q"], t["k"], t["v"], t["q_offsets"], t["k_offsets"], t["max_len_q"], t["max_len_k"],
                    activation=w.activation, pre_scale=1 / math.sqrt(HEAD_DIM), norm="max_len", causal=w.causal,
                    num_targets=t["num_targets"], broadcast_q=w.broadcast_q)

    return run


def _padded_mask(w: Workload, q_len: torch.Tensor, k_len: torch.Tensor, lq: int, lk: int,
                 num_targets: torch.Tensor | None) -> torch.Tensor:
    """Bool [B, 1, Lq, Lk]: the same mask as the jagged op, on the padded layout."""
    i = torch.arange(lq, device=q_len.device)[None, :, None]
    j = torch.arange(lk, device=q_len.device)[None, None, :]
    valid = (i < q_len[:, None, None]) & (j < k_len[:, None, None])
    if w.causal:
        hist = (k_len - num_targets.to(k_len.device))[:, None, None]
        p = torch.minimum(i, hist)
        valid = valid & (((j < hist) & (j <= p)) | (i == j))
    return valid[:, None]


def padded_gdpa(q, k, v, mask, activation: str, pre_scale: float, out_scale: float) -> torch.Tensor:
    """Dense padded GDPA: [B, H, Lq, Lk] scores, activation, mask, matmul (the no-kernel baseline)."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k).float() * pre_scale
    weights = torch.where(mask, activation_value(activation, scores), 0.0).to(v.dtype)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v) * out_scale


def _pad(x: torch.Tensor, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[T, H, D] -> [B, H, max_len, D] (zeros beyond each length)."""
    out = x.new_zeros(lengths.numel(), max_len, *x.shape[1:])
    rows = torch.arange(max_len, device=x.device)[None, :] < lengths.to(x.device)[:, None]
    out[rows] = x
    return out.transpose(1, 2).detach().requires_grad_(True)


def _padded_peer(w: Workload, t: dict[str, Any], compiled: bool,
                 max_samples: int | None) -> tuple[Callable[[], torch.Tensor], tuple, int]:
    """(fn, leaves, sub_batch): the dense padded math on the largest sub-batch that fits the budget (and
    ``max_samples``); its time scales linearly with the batch, so the caller scales it to the full batch."""
    lq, lk = t["max_len_q"], t["max_len_k"]
    per_sample = HEADS * lq * lk * PADDED_BYTES_PER_SCORE
    sub = max(1, min(w.k_lengths.numel(), PADDED_BUDGET_BYTES // per_sample, max_samples or BATCH))
    device = t["k"].device
    k_len = w.k_lengths[:sub].to(device)
    k_rows = int(w.k_lengths[:sub].sum())
    if w.broadcast_q:
        qp = t["q"].detach().transpose(0, 1)[None].expand(sub, -1, -1, -1).contiguous().requires_grad_(True)
        q_len = torch.full_like(k_len, lq)
    else:
        q_len = w.q_lengths[:sub].to(device)
        qp = _pad(t["q"].detach()[: int(w.q_lengths[:sub].sum())], q_len, lq)
    kp, vp = (_pad(x.detach()[:k_rows], k_len, lk) for x in (t["k"], t["v"]))
    targets = None if w.num_targets is None else w.num_targets[:sub]
    mask = _padded_mask(w, q_len, k_len, lq, lk, targets)
    args = (qp, kp, vp, mask, w.activation, 1 / math.sqrt(HEAD_DIM), 1.0 / lk)
    if compiled:
        # donated buffers (a memory saving) forbid retain_graph, which the backward timing needs (session 10:
        # every compiled-peer row failed so); AOTAutograd reads the flag when it compiles the backward, at
        # the first backward call, so it stays off for the rest of the run
        torch._functorch.config.donated_buffer = False
    fn = torch.compile(padded_gdpa, dynamic=False) if compiled else padded_gdpa
    return (lambda: fn(*args)), (qp, kp, vp), sub


def _jfa_peer(w: Workload, t: dict[str, Any]) -> Callable[[], torch.Tensor]:
    """Our softmax JFA on the same self-attention shape (the caller checks ``w.self_attention``)."""
    from opengem.ops.jagged_attention import jagged_attention

    return lambda: jagged_attention(t["q"], t["k"], t["v"], t["k_offsets"], t["max_len_k"], causal=w.causal,
                                    num_targets=t["num_targets"])


def _flex_peer(w: Workload, t: dict[str, Any]) -> tuple[Callable[[], torch.Tensor], tuple]:
    """FlexAttention (softmax) on the padded layout with a length (and HSTU) mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = t["k"].device
    lq, lk = t["max_len_q"], t["max_len_k"]
    batch = w.k_lengths.numel()
    k_len = w.k_lengths.to(device)
    q_len = torch.full_like(k_len, lq) if w.broadcast_q else w.q_lengths.to(device)
    hist = k_len - (0 if w.num_targets is None else w.num_targets.to(device))
    causal = w.causal

    def mask_mod(b, h, i, j):
        valid = (i < q_len[b]) & (j < k_len[b])
        if causal:
            valid = valid & (((j < hist[b]) & (j <= torch.minimum(i, hist[b]))) | (i == j))
        return valid

    block_mask = create_block_mask(mask_mod, batch, None, lq, lk, device=device, _compile=True)
    if w.broadcast_q:
        qp = t["q"].detach().transpose(0, 1)[None].expand(batch, -1, -1, -1).contiguous().requires_grad_(True)
    else:
        qp = _pad(t["q"].detach(), q_len, lq)
    kp, vp = _pad(t["k"].detach(), k_len, lk), _pad(t["v"].detach(), k_len, lk)
    compiled = torch.compile(flex_attention, dynamic=False)
    return (lambda: compiled(qp, kp, vp, block_mask=block_mask)), (qp, kp, vp)


def _sync() -> None:
    """Wait for the device, so an asynchronous error surfaces in the variant that caused it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn: Callable[[], torch.Tensor], leaves: tuple[torch.Tensor, ...]) -> tuple[float, float, float]:
    """(forward, backward, forward+backward) milliseconds."""
    out = fn()
    grad = torch.randn_like(out)
    torch.autograd.grad(out, leaves, grad)  # compile outside the timed region
    with torch.no_grad():
        fwd = bench_ms(fn)
    out = fn()
    bwd = bench_ms(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True))
    both = bench_ms(lambda: torch.autograd.grad(fn(), leaves, grad))
    _sync()
    return fwd, bwd, both


def _errors(w: Workload, t: dict[str, Any]) -> dict[str, float]:
    """Relative errors of out/dq/dk/dv against the fp32 reference on the first ERROR_SAMPLES samples.

    The sub-batch keeps the full batch's max lengths: same kernel configuration (tuning key) and the
    same ``1 / max_len_k`` output scale."""
    n = min(ERROR_SAMPLES, w.k_lengths.numel())
    sub = Workload(w.name, w.q_lengths[:n], w.k_lengths[:n], w.activation, w.broadcast_q, w.causal,
                   None if w.num_targets is None else w.num_targets[:n])
    s = {**_tensors(sub, str(t["k"].device)), "max_len_q": t["max_len_q"], "max_len_k": t["max_len_k"]}
    out = _ours(sub, s)()
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (s["q"], s["k"], s["v"]), grad)
    kwargs = dict(head_activations=[w.activation] * HEADS, pre_scale=1 / math.sqrt(HEAD_DIM),
                  out_scale=1.0 / s["max_len_k"], causal=w.causal, num_targets=s["num_targets"],
                  broadcast_q=w.broadcast_q)
    qf, kf, vf = (x.detach().float() for x in (s["q"], s["k"], s["v"]))
    q_offsets = s["k_offsets"] if w.broadcast_q else s["q_offsets"]
    ref = reference.gdpa(qf, kf, vf, q_offsets, s["k_offsets"], **kwargs)
    ref_grads = reference.gdpa_backward(grad.float(), qf, kf, vf, q_offsets, s["k_offsets"], **kwargs)
    errors = {"err_out": relative_error(out.detach(), ref)}
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        errors[f"err_{name}"] = relative_error(got, want)
    return errors


def _row(w: Workload, impl: str, times: tuple[float, float, float] | None, flops: tuple[int, int],
         note: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"workload": w.name, "impl": impl, "note": note}
    if times is not None:
        fwd, bwd, both = times
        row.update(fwd_ms=fwd, bwd_ms=bwd, fwdbwd_ms=both, fwd_tflops=flops[0] / fwd / 1e9,
                   bwd_tflops=flops[1] / bwd / 1e9, fwdbwd_tflops=(flops[0] + flops[1]) / both / 1e9)
    return row


def _failure(w: Workload, impl: str, flops: tuple[int, int], exc: BaseException) -> dict[str, Any]:
    """A failed variant's row (its error text); the device is synced and its cache freed for the next."""
    note = "oom" if isinstance(exc, torch.OutOfMemoryError) else f"error: {type(exc).__name__}: {exc}"[:200]
    try:
        _sync()
        torch.cuda.empty_cache()
    except Exception:  # a poisoned context fails here too; the row already says why
        pass
    return _row(w, impl, None, flops, note)


def _measure_ours(w: Workload, flops: tuple[int, int], device: str) -> dict[str, Any]:
    t = _tensors(w, device)
    try:
        row = _row(w, "gdpa", _time(_ours(w, t), (t["q"], t["k"], t["v"])), flops)
    except Exception as exc:  # our failure on one workload must not lose the others
        return _failure(w, "gdpa", flops, exc)
    try:
        row.update(_errors(w, t))
        _sync()
    except Exception as exc:  # keep the timings; the row says the check did not run
        row["note"] = _failure(w, "gdpa", flops, exc)["note"].replace("error:", "error check failed:", 1)
    return row


def _measure_peer(w: Workload, impl: str, flops: tuple[int, int], quick: bool, device: str) -> dict[str, Any]:
    """One peer's row; a sub-batch peer's times are scaled to the full batch; failures are recorded."""
    if impl == "jfa" and not w.self_attention:
        return _row(w, impl, None, flops, "n/a (not self-attention)")
    t = _tensors(w, device)
    try:
        if impl == "jfa":
            fn, leaves, sub = _jfa_peer(w, t), (t["q"], t["k"], t["v"]), None
        elif impl == "flex(softmax)":
            fn, leaves = _flex_peer(w, t)
            sub = None
        else:
            fn, leaves, sub = _padded_peer(w, t, impl == "padded-compiled", QUICK_PADDED_SAMPLES if quick else None)
        times = _time(fn, leaves)
    except Exception as exc:  # a peer failing must not lose the rest of the run
        return _failure(w, impl, flops, exc)
    note = ""
    batch = w.k_lengths.numel()
    if sub is not None and sub < batch:
        times = tuple(ms * batch / sub for ms in times)
        note = f"timed on {sub}/{batch} samples, scaled x{batch / sub:.1f}"
    return _row(w, impl, times, flops, note)


def _paired_fwd_x_jfa(w: Workload, device: str, rounds: int = PAIRED_ROUNDS,
                      bench: Callable[[Callable[[], Any]], float | None] | None = None) -> float | None:
    """JFA forward time / GDPA forward time, median over interleaved rounds on one set of inputs (no autograd).
    ``bench``: ``bench_ms`` (the ops as called: host time shows where it exceeds the device's) by default, or
    ``bench_graph_ms`` (CUDA-graph replays: device time only); None where it gives no time (a call that syncs)."""
    bench = bench or bench_ms
    t = _tensors(w, device)
    fns = {"jfa": _jfa_peer(w, t), "gdpa": _ours(w, t)}
    with torch.no_grad():
        # one untimed call each: bench_graph_ms captures only calls that ran before (host caches warm, no sync)
        for fn in fns.values():
            fn()
        _sync()
        times = interleaved_ms(fns, rounds=rounds, bench=bench)
    _sync()
    if any(ms is None for ms in (*times["jfa"], *times["gdpa"])):
        return None
    return paired_speedup(times["jfa"], times["gdpa"])


def _ratios(row: dict[str, Any], ours: dict[str, Any] | None) -> None:
    """Our speedup over a peer (peer time / our time) for fwd, bwd and fwd+bwd, on the peer's row."""
    if ours is None or "fwd_ms" not in ours or "fwd_ms" not in row:
        return
    for kind in ("fwd", "bwd", "fwdbwd"):
        row[f"x_{kind}"] = row[f"{kind}_ms"] / ours[f"{kind}_ms"]


class Results:
    """The rows so far: each new row is printed on one line and the JSON rewritten at once, so a run
    killed by a timeout still leaves every finished number behind."""

    def __init__(self, quick: bool) -> None:
        self.rows: list[dict[str, Any]] = []
        self.quick = quick
        self.start = time.time()

    def add(self, row: dict[str, Any]) -> None:
        row["elapsed_s"] = round(time.time() - self.start, 1)
        self.rows.append(row)
        meta = {"quick": self.quick, "acceptance": acceptance(self.rows), "tuning": triton_gdpa.tuning_report()}
        write_results("gdpa", self.rows, meta)
        print(" | ".join(f"{c}={_short(row[c])}" for c in [*COLUMNS, "elapsed_s"] if row.get(c) not in (None, "")),
              flush=True)

    def ours(self, workload: str) -> dict[str, Any] | None:
        return next((r for r in self.rows if r["workload"] == workload and r["impl"] == "gdpa"), None)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def run(quick: bool, device: str = "cuda", prefixes: list[str] | None = None,
        peers: tuple[str, ...] = PEERS) -> list[dict[str, Any]]:
    """Our kernel on every chosen workload, then each peer on every one (rows as they finish)."""
    results = Results(quick)
    chosen = by_name_prefix(workloads(quick), prefixes, "--workloads")
    flops = {w.name: workload_flops(w) for w in chosen}
    for w in chosen:
        results.add(_measure_ours(w, flops[w.name], device))
    for impl in peers:
        for w in chosen:
            if quick and impl in QUICK_SKIPS:
                row = _row(w, impl, None, flops[w.name], QUICK_SKIPS[impl])
            else:
                torch._dynamo.reset()  # fresh static-shape compiles, clear of the recompile limit
                row = _measure_peer(w, impl, flops[w.name], quick, device)
            _ratios(row, results.ours(w.name))
            if impl == "jfa" and "fwd_ms" in row and "fwd_ms" in (results.ours(w.name) or {}):
                try:
                    row["x_fwd_paired"] = _paired_fwd_x_jfa(w, device)
                    if device == "cuda":  # short batches are host-bound (session 24): the kernels' ratio beside it
                        row["x_fwd_graph"] = _paired_fwd_x_jfa(w, device, bench=bench_graph_ms)
                except Exception as exc:  # the separate timings stand; the row says why the pairing is missing
                    row["note"] = _failure(w, impl, flops[w.name], exc)["note"].replace("error:", "paired failed:", 1)
            results.add(row)
    return results.rows


def acceptance(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 4's acceptance targets, checked on this run's rows (None: the peer or figure is missing)."""
    checks: list[dict[str, Any]] = []

    def peer(workload: str, impl: str) -> dict[str, Any]:
        return next((r for r in rows if r["workload"] == workload and r["impl"] == impl), {})

    def check(workload: str, what: str, value: float | None, target: float) -> None:
        verdict = None if value is None else value >= target
        checks.append({"workload": workload, "check": what, "value": value, "target": target, "pass": verdict})

    for ours in (r for r in rows if r["impl"] == "gdpa"):
        name = ours["workload"]
        compiled, jfa = peer(name, "padded-compiled"), peer(name, "jfa")
        if name.startswith(("a ", "b ")):
            check(name, "fwd x padded-compiled", compiled.get("x_fwd"), 3.0)
            check(name, "bwd x padded-compiled", compiled.get("x_bwd"), 2.0)
            check(name, "fwd x jfa", jfa.get("x_fwd"), 1.1)
            check(name, "fwd x jfa (interleaved)", jfa.get("x_fwd_paired"), 1.1)
            check(name, "fwd x jfa (interleaved, device time)", jfa.get("x_fwd_graph"), 1.1)
        if name.startswith("b ") and name.endswith("KV=256"):
            check(name, "fwd TFLOP/s", ours.get("fwd_tflops"), 400.0)
            check(name, "bwd TFLOP/s", ours.get("bwd_tflops"), 250.0)
        if name.startswith("c "):
            check(name, "fwd+bwd x padded-compiled", compiled.get("x_fwdbwd"), 2.0)
        if name.startswith("d "):
            check(name, "fwd+bwd x padded-compiled", compiled.get("x_fwdbwd"), 3.0)
    return checks


COLUMNS = ["workload", "impl", "fwd_tflops", "bwd_tflops", "fwdbwd_tflops", "fwd_ms", "bwd_ms", "fwdbwd_ms",
           "x_fwd", "x_fwd_paired", "x_fwd_graph", "x_bwd", "x_fwdbwd", "err_out", "err_dq", "err_dk", "err_dv", "note"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="(a) L=1024 and (b) KV=256, untuned, no compiles")
    parser.add_argument("--workloads", type=lambda text: text.split(","), default=None,
                        help="comma-separated name prefixes of the workloads to run (default: all)")
    parser.add_argument("--peers", type=lambda text: tuple(text.split(",")), default=PEERS,
                        help=f"comma-separated peers to time, of {list(PEERS)} (default: all)")
    args = parser.parse_args()
    quick = args.quick
    unknown = set(args.peers) - set(PEERS)
    if unknown:
        raise SystemExit(f"--peers: unknown {sorted(unknown)}; choose from {list(PEERS)}")
    if quick:  # the kernels' default configurations: no tuning compiles or timing on a cold start
        os.environ.setdefault("OPENGEM_GDPA_TUNE", "0")
        os.environ.setdefault("OPENGEM_JFA_AUTOTUNE", "0")
    rows = run(quick, prefixes=args.workloads, peers=tuple(p for p in PEERS if p in args.peers))  # safest first
    print_table(rows, COLUMNS)
    print("x_* = peer time / gdpa time (>1: gdpa faster). TFLOP/s: useful FLOPs, GEM_SPEC section 8.")
    checks = acceptance(rows)
    print_table(checks, ["workload", "check", "value", "target", "pass"])
    print(write_results("gdpa", rows, {"quick": quick, "acceptance": checks, "tuning": triton_gdpa.tuning_report()}))


if __name__ == "__main__":
    main()
