"""`opengem bench calibrate`: measure the planner's calibration table (``opengem.plan.calibration``) on this GPU.

Every figure the table holds is timed here (CUDA events, median of ``triton.testing.do_bench``), each op
first checked against its reference on a small case in the same run (the run fails when one is off):

- bf16 GEMMs: ``F.linear`` forward + backward at the (M, N, K) shapes of the GEM presets' projections;
- JFA, GDPA (PFFN cross-attention with short K/V plus broadcast-query seed pooling) and BlockAttention,
  forward and backward, through the public ops (offsets carry host mirrors: no sync per call);
- the fused embedding lookup and its row-wise Adagrad update inside the backward;
- a fused norm (``layer_norm`` forward + backward: element-wise bandwidth), a device-to-device and a
  pinned host-to-device copy, and the host time of one tiny kernel launch;
- with a host probe: the host time of a compiled GEM training step, per step and per layer
  (``opengem.train.bench.host_probe``), which replaces the planner's launch-count host model.

``--quick`` measures fewer shapes with the kernels' default configs (no autotuning: fewer compiles).
"""

from __future__ import annotations

import datetime
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from opengem.jagged.host import to_device
from opengem.models.presets import GEM_PRESETS
from opengem.nn.numerics import relative_error
from opengem.ops.block_attention import block_attention
from opengem.ops.embedding import FusedUpdate, LookupLayout, embedding_lookup
from opengem.ops.gdpa import gdpa
from opengem.ops.jagged_attention import attention_pairs, jagged_attention
from opengem.ops.reference import embedding as embedding_reference
from opengem.plan.calibration import Measurements
from opengem.train.bench.host_probe import HostProbe, measure_host
from opengem.train.flops import DEVICE_PEAKS, device_peak_flops
from opengem.validation import check_optional_positive_finite

DEVICE = "cuda"
HEADS, HEAD_DIM, BLOCK = 4, 128, 64  # every GEM preset has 128-wide heads; block: BlockAttention's default
TOLERANCE = 3e-2  # relative error of a bf16 op against its fp32 reference
CEILING = (8192, 8192, 8192)  # the square GEMM: the device's reachable BF16 ceiling
LAUNCHES = 2000  # tiny kernels timed for the host cost of one launch
NOMINAL_HBM_GBPS = {  # datasheet HBM bandwidth, keyed like opengem.train.flops.DEVICE_PEAKS
    "GB200": 8000.0, "B200": 8000.0, "H200 NVL": 4800.0, "H200": 4800.0, "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0, "H100 SXM": 3350.0, "A100": 2039.0,
}  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """What one run measures."""

    gemm_rows: tuple[int, ...]  # M of every preset projection shape (plus the square ceiling)
    jfa_lengths: tuple[int, ...]  # causal sequence lengths (keys per query ~ L / 2)
    gdpa_short: tuple[int, ...]  # K/V lengths of the cross-attention = seeds of the pooling
    tokens: int  # tokens per attention batch
    history: int  # history length of the GDPA and BlockAttention batches
    embedding_batch: int
    embedding_rows: int  # rows per table
    tune: bool  # let the attention kernels autotune (as training does) or take their default configs
    warmup_ms: int = 10
    rep_ms: int = 50


FULL = Sizes(
    (4096, 16384, 65536),
    (256, 512, 1024, 2048, 4096, 8192),
    (8, 16, 32, 64, 256),
    1 << 18,
    1024,
    4096,
    1_000_000,
    tune=True,
)
QUICK = Sizes((65536,), (512, 4096), (16, 32), 1 << 18, 1024, 2048, 1_000_000, tune=False, warmup_ms=5, rep_ms=25)


def gemm_shapes(rows: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(M, N, K) of the presets' fused QKV (N = 3 d) and square (N = d) projections, plus the ceiling."""
    widths = sorted({p.model.d_model for name, p in GEM_PRESETS.items() if name != "gem-tiny"})
    return [CEILING] + [(m, n * d, d) for d in widths for n in (3, 1) for m in rows]


def nominal_hbm_gbps(device_name: str) -> float:
    for name, peak in DEVICE_PEAKS.items():
        if re.search(peak.pattern, device_name, flags=re.IGNORECASE) and name in NOMINAL_HBM_GBPS:
            return NOMINAL_HBM_GBPS[name]
    raise ValueError(f"unknown device {device_name!r}: no HBM bandwidth known; pass --hbm-gbps")


class NoCudaDevice(RuntimeError):
    """Calibration measures a GPU: there is none."""


class Run:
    """Timing and correctness plumbing of one calibration run (prints each figure as it is measured)."""

    def __init__(self, sizes: Sizes) -> None:
        self.sizes = sizes
        self.errors: dict[str, float] = {}
        self.generator = torch.Generator(device=DEVICE).manual_seed(0)

    def ms(self, fn: Callable[[], object]) -> float:
        import triton.testing

        fn()  # compiles and tunes outside the timed window
        torch.cuda.synchronize()
        return float(
            triton.testing.do_bench(fn, warmup=self.sizes.warmup_ms, rep=self.sizes.rep_ms, return_mode="median")
        )

    def randn(self, *shape: int, dtype: torch.dtype = torch.bfloat16, grad: bool = False) -> torch.Tensor:
        x = torch.randn(*shape, device=DEVICE, generator=self.generator).to(dtype)
        return x.requires_grad_(grad)

    def check(self, name: str, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
        error = max(relative_error(a, b) for a, b in zip(got, want, strict=True))
        self.errors[name] = error
        print(f"[check] {name}: relative error {error:.2e}", flush=True)

    def check_backends(self, name: str, fn: Callable[[str], torch.Tensor], leaves: tuple[torch.Tensor, ...]) -> None:
        """The op's output and every input gradient, Triton against the reference path."""
        out = fn("triton")
        grad = torch.randn_like(out)
        got = (out, *torch.autograd.grad(out, leaves, grad))
        ref = fn("reference")
        self.check(name, got, (ref, *torch.autograd.grad(ref, leaves, grad.to(ref.dtype))))

    def fwd_bwd_ms(self, fn: Callable[[], torch.Tensor], leaves: tuple[torch.Tensor, ...]) -> tuple[float, float]:
        with torch.no_grad():
            forward = self.ms(fn)
        out = fn()
        grad = torch.randn_like(out)
        backward = self.ms(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True))
        return forward, backward


def jagged(lengths: list[int]) -> tuple[torch.Tensor, int]:
    """Offsets on the GPU with their host mirror (the ops' validation then reads it without a sync)."""
    host = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    host[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return to_device(host, torch.device(DEVICE)), max(lengths, default=0)


def measure_gemm(run: Run) -> list[list[float]]:
    x, w = run.randn(64, 96, grad=True), run.randn(80, 96, grad=True)
    out = F.linear(x, w)
    ref = F.linear(x.float(), w.float())
    grad = torch.randn_like(ref)
    run.check(
        "gemm",
        (out, *torch.autograd.grad(out, (x, w), grad.bfloat16())),
        (ref, *torch.autograd.grad(ref, (x, w), grad)),
    )
    points = []
    for m, n, k in gemm_shapes(run.sizes.gemm_rows):
        x, w = run.randn(m, k, grad=True), run.randn(n, k, grad=True)
        grad = run.randn(m, n)
        ms = run.ms(lambda: torch.autograd.grad(F.linear(x, w), (x, w), grad))
        points.append([m, n, k, 6 * m * n * k / ms / 1e9])
        print(f"[gemm] {m} x {n} x {k}: {points[-1][3]:.0f} TFLOP/s", flush=True)
    return points


def measure_jfa(run: Run) -> list[list[float]]:
    offsets, max_len = jagged([5, 40, 1, 0, 33])
    q, k, v = (run.randn(79, 2, HEAD_DIM, grad=True) for _ in range(3))
    run.check_backends("jfa", lambda b: jagged_attention(q, k, v, offsets, max_len, backend=b), (q, k, v))
    points = []
    for length in run.sizes.jfa_lengths:
        offsets, _ = jagged([length] * max(run.sizes.tokens // length, 1))
        tokens = int(offsets[-1])
        q, k, v = (run.randn(tokens, HEADS, HEAD_DIM, grad=True) for _ in range(3))
        forward, backward = run.fwd_bwd_ms(lambda: jagged_attention(q, k, v, offsets, length), (q, k, v))
        pairs = attention_pairs(offsets, causal=True)
        flops = 4 * HEADS * HEAD_DIM * pairs
        points.append([pairs / tokens, flops / forward / 1e9, 2.5 * flops / backward / 1e9])
        print(f"[jfa] L {length}: fwd {points[-1][1]:.0f}, bwd {points[-1][2]:.0f} TFLOP/s", flush=True)
    return points


def measure_gdpa(run: Run) -> list[list[float]]:
    scale = HEAD_DIM**-0.5
    q_off, max_q = jagged([7, 30, 0, 12])
    k_off, max_k = jagged([3, 8, 2, 0])
    q, k, v = (
        run.randn(49, 2, HEAD_DIM, grad=True),
        run.randn(13, 2, HEAD_DIM, grad=True),
        run.randn(13, 2, HEAD_DIM, grad=True),
    )
    run.check_backends(
        "gdpa_cross", lambda b: gdpa(q, k, v, q_off, k_off, max_q, max_k, pre_scale=scale, backend=b), (q, k, v)
    )
    seeds, kv = run.randn(4, 2, HEAD_DIM, grad=True), run.randn(49, 2, HEAD_DIM, grad=True)
    run.check_backends(
        "gdpa_pooling",
        lambda b: gdpa(seeds, kv, kv, None, q_off, 4, max_q, pre_scale=scale, broadcast_q=True, backend=b),
        (seeds, kv),
    )
    history = run.sizes.history
    batch = max(run.sizes.tokens // history, 1)
    h_off, _ = jagged([history] * batch)
    x = run.randn(batch * history, HEADS, HEAD_DIM, grad=True)  # the histories: PFFN queries, pooling keys and values
    points = []
    for short in run.sizes.gdpa_short:
        s_off, _ = jagged([short] * batch)
        kv_short = run.randn(batch * short, HEADS, HEAD_DIM, grad=True)
        seeds = run.randn(short, HEADS, HEAD_DIM, grad=True)
        cross = run.fwd_bwd_ms(
            lambda: gdpa(x, kv_short, kv_short, h_off, s_off, history, short, pre_scale=scale, post_scale=1.0 / short),
            (x, kv_short),
        )
        pooling = run.fwd_bwd_ms(
            lambda: gdpa(seeds, x, x, None, h_off, short, history, pre_scale=scale, broadcast_q=True), (seeds, x)
        )
        flops = 2 * 4 * HEADS * HEAD_DIM * batch * history * short  # both ops see history x short pairs per sample
        points.append([short, flops / (cross[0] + pooling[0]) / 1e9, 2.5 * flops / (cross[1] + pooling[1]) / 1e9])
        print(f"[gdpa] short {short}: fwd {points[-1][1]:.0f}, bwd {points[-1][2]:.0f} TFLOP/s", flush=True)
    return points


def measure_block_attention(run: Run) -> list[float]:
    offsets, max_len = jagged([70, 1, 0, 129])
    q, k, v = (run.randn(200, 2, HEAD_DIM, grad=True) for _ in range(3))
    run.check_backends(
        "block_attention", lambda b: block_attention(q, k, v, offsets, max_len, block_size=BLOCK, backend=b), (q, k, v)
    )
    history = run.sizes.history
    offsets, _ = jagged([history] * max(run.sizes.tokens // history, 1))
    tokens = int(offsets[-1])
    q, k, v = (run.randn(tokens, HEADS, HEAD_DIM, grad=True) for _ in range(3))
    forward, backward = run.fwd_bwd_ms(lambda: block_attention(q, k, v, offsets, history, block_size=BLOCK), (q, k, v))
    unit = tokens * HEADS * HEAD_DIM * 2  # one bf16 [T, H, D] tensor
    rates = [4 * unit / forward / 1e6, 7 * unit / backward / 1e6]
    print(f"[block_attention] fwd {rates[0]:.0f}, bwd {rates[1]:.0f} GB/s", flush=True)
    return rates


@dataclass
class EmbeddingBatch:
    weights: torch.Tensor
    layout: LookupLayout
    ids: torch.Tensor
    offsets: torch.Tensor
    update: FusedUpdate
    rows_read_bytes: int


def embedding_batch(run: Run, tables: int, rows: int, dim: int, batch: int, pooling: int) -> EmbeddingBatch:
    """``tables`` fp32 tables of ``rows`` x ``dim``: pooled features (bags of 0..2 ``pooling`` ids) and one
    sequence feature (0..2 ``pooling`` ids per sample, unpooled) on the last table; uniform ids."""
    cpu = torch.Generator().manual_seed(0)
    features = list(range(tables)) + [tables - 1]
    lengths = torch.randint(0, 2 * pooling + 1, (len(features), batch), generator=cpu)
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=cpu)
    layout = LookupLayout.build(
        [(t * rows * dim, t * rows, rows, dim) for t in range(tables)],
        features,
        ["sum"] * tables + ["none"],
        lengths.sum(1).tolist(),
        batch,
        DEVICE,
    )
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths.flatten(), 0)
    weights = torch.randn(tables * rows * dim, device=DEVICE, generator=run.generator)
    update = FusedUpdate(
        "rowwise_adagrad",
        torch.zeros(tables * rows, device=DEVICE),
        torch.zeros(0, device=DEVICE),
        torch.zeros(1, dtype=torch.int64, device=DEVICE),
        torch.zeros(0, device=DEVICE, requires_grad=True),
    )
    return EmbeddingBatch(weights, layout, ids.to(DEVICE), offsets.to(DEVICE), update, ids.numel() * dim * 4)


def measure_embedding(run: Run) -> tuple[float, float]:
    """(fused step GB/s as the cost model charges it, lookup-alone GB/s)."""
    small = embedding_batch(run, 2, 50, 16, 6, 3)
    meta = (small.layout.feature_meta, small.ids, small.offsets, small.layout.batch_size)
    state = (small.update.row_state.clone(), small.update.elem_state, small.update.step.clone())
    before, want_weights = small.weights.clone(), small.weights.clone()
    with torch.no_grad():
        want = embedding_reference.embedding_lookup(small.weights, *meta, small.layout.out_numel)
    grad = torch.randn(small.layout.out_numel, device=DEVICE, generator=run.generator)
    embedding_reference.embedding_fused_update_(
        grad,
        want_weights,
        *state,
        *meta,
        embedding_reference.OPT_ROWWISE_ADAGRAD,
        small.update.lr,
        small.update.eps,
        *small.update.betas,
        0.0,
    )
    out = embedding_lookup(small.weights, small.layout, small.ids, small.offsets, small.update)
    got = out.detach().clone()
    out.backward(grad)
    run.check("embedding", (got, small.weights - before), (want, want_weights - before))  # output and the update
    big = embedding_batch(run, 4, run.sizes.embedding_rows, 128, run.sizes.embedding_batch, 20)
    grad = torch.randn(big.layout.out_numel, device=DEVICE, generator=run.generator)
    with torch.no_grad():
        forward = run.ms(lambda: embedding_lookup(big.weights, big.layout, big.ids, big.offsets))
    step = run.ms(lambda: embedding_lookup(big.weights, big.layout, big.ids, big.offsets, big.update).backward(grad))
    step_gbps = 3 * big.rows_read_bytes / step / 1e6
    forward_gbps = (big.rows_read_bytes + big.layout.out_numel * 4) / forward / 1e6
    print(f"[embedding] fused step {step_gbps:.0f} GB/s (3 x rows read), lookup {forward_gbps:.0f} GB/s", flush=True)
    return step_gbps, forward_gbps


def measure_memory(run: Run) -> dict[str, float]:
    """Fused norm (element-wise), device-to-device and pinned host-to-device copy bandwidths, in GB/s."""
    x, w = run.randn(96, 256, grad=True), run.randn(256, grad=True)
    out = F.layer_norm(x, (256,), w)
    ref = F.layer_norm(x.float(), (256,), w.float())
    grad = torch.randn_like(ref)
    run.check(
        "layer_norm",
        (out, *torch.autograd.grad(out, (x, w), grad.bfloat16())),
        (ref, *torch.autograd.grad(ref, (x, w), grad)),
    )
    x, w = run.randn(1 << 16, 1024, grad=True), run.randn(1024, grad=True)
    grad = run.randn(1 << 16, 1024)
    norm_ms = run.ms(lambda: torch.autograd.grad(F.layer_norm(x, (1024,), w), (x, w), grad))
    figures = {"norm_gbps": 5 * x.numel() * 2 / norm_ms / 1e6}  # fwd reads x, writes y; bwd reads dy, x, writes dx
    source = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    target = torch.empty_like(source)
    figures["copy_gbps"] = 2 * source.numel() / run.ms(lambda: target.copy_(source)) / 1e6
    pinned = torch.empty(1 << 28, dtype=torch.uint8).pin_memory()
    figures["h2d_gbps"] = (
        pinned.numel() / run.ms(lambda: target[: pinned.numel()].copy_(pinned, non_blocking=True)) / 1e6
    )
    print("[memory] " + ", ".join(f"{k} {v:.0f}" for k, v in figures.items()), flush=True)
    return figures


def measure_launch_us() -> float:
    """Host microseconds per launch of a tiny kernel (eager op dispatch + CUDA launch; the GPU keeps up)."""
    x = torch.zeros(1, device=DEVICE)
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(LAUNCHES):
        x.add_(1)
    launch_us = (time.perf_counter() - start) / LAUNCHES * 1e6
    torch.cuda.synchronize()
    print(f"[host] {launch_us:.1f} us per tiny kernel launch", flush=True)
    return launch_us


def measure(sizes: Sizes, peak_tflops: float | None = None, hbm_gbps: float | None = None,
            host_probe: HostProbe | None = None) -> Measurements:
    """Run every measurement on the current CUDA device; raises :class:`NoCudaDevice` without one,
    ``ValueError`` when an op misses its reference by more than ``TOLERANCE``. ``host_probe``: also time
    the host side of a training step (``opengem.train.bench.host_probe``)."""
    # first: even without CUDA, bad input is named
    check_optional_positive_finite(peak_tflops=peak_tflops, hbm_gbps=hbm_gbps)
    if not torch.cuda.is_available():
        raise NoCudaDevice("opengem bench calibrate needs a CUDA device (torch.cuda.is_available() is False)")
    if not sizes.tune:  # read by the kernels' tuners at their first call
        os.environ.setdefault("OPENGEM_JFA_AUTOTUNE", "0")
        os.environ.setdefault("OPENGEM_GDPA_TUNE", "0")
    device = torch.cuda.get_device_name()
    peak = device_peak_flops(device, "bf16", peak_tflops) / 1e12
    hbm = hbm_gbps if hbm_gbps is not None else nominal_hbm_gbps(device)
    start = time.perf_counter()
    run = Run(sizes)
    launch_us = measure_launch_us()
    memory = measure_memory(run)
    gemm = measure_gemm(run)
    jfa = measure_jfa(run)
    gdpa_points = measure_gdpa(run)
    block = measure_block_attention(run)
    embedding_gbps, embedding_forward = measure_embedding(run)
    host = measure_host(host_probe, torch.device(DEVICE)) if host_probe is not None else {}
    bad = {op: error for op, error in run.errors.items() if not error <= TOLERANCE}
    if bad:
        raise ValueError(f"ops off their reference (relative error > {TOLERANCE}): {bad}; no table written")
    import triton

    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    tuning = "autotuned" if sizes.tune else "default kernel configs (no autotuning)"
    kind = "quick" if sizes is QUICK else "full" if sizes is FULL else "custom"
    return Measurements(
        device=device, peak_bf16_tflops=peak, hbm_gbps=hbm,
        run=(f"opengem bench calibrate ({kind} sizes) on {device}, {date}, torch {torch.__version__}, "
             f"triton {triton.__version__}, attention {tuning}, {time.perf_counter() - start:.0f} s"),
        gemm=gemm, jfa=jfa, gdpa=gdpa_points, block_attention_gbps=block, embedding_gbps=embedding_gbps,
        copy_gbps=memory.pop("copy_gbps"),
        raw={"launch_us": launch_us, **memory, "embedding_forward_gbps": embedding_forward, **host}, errors=run.errors,
    )  # fmt: skip


def format_table(m: Measurements) -> str:
    lines = [f"calibration of {m.device} (peak {m.peak_bf16_tflops:.0f} TFLOP/s, HBM {m.hbm_gbps:.0f} GB/s)"]
    lines += [
        f"  gemm {mm} x {n} x {k}: {t:.0f} TFLOP/s ({100 * t / m.peak_bf16_tflops:.0f} % of peak)"
        for mm, n, k, t in m.gemm
    ]
    for family, points in (("jfa", m.jfa), ("gdpa", m.gdpa)):
        lines += [f"  {family} at {x:.0f} keys: fwd {f:.0f}, bwd {b:.0f} TFLOP/s" for x, f, b in points]
    lines.append(f"  block attention: fwd {m.block_attention_gbps[0]:.0f}, bwd {m.block_attention_gbps[1]:.0f} GB/s")
    lines.append(f"  embedding (fused step) {m.embedding_gbps:.0f} GB/s, copy {m.copy_gbps:.0f} GB/s")
    lines.append("  " + ", ".join(f"{k} {v:.3g}" for k, v in m.raw.items()))
    lines.append("  errors: " + ", ".join(f"{k} {v:.1e}" for k, v in m.errors.items()))
    return "\n".join(lines)
