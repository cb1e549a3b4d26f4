"""Jagged Flash Attention benchmark (issue 3): JFA against PyTorch's attention kernels, same process, same data.

Workloads (bf16, H = 4, D = 128):
  (a) power-law lengths 100..16384, about 150k tokens, causal;
  (b) B = 1152 at max length 512..4096 and sparsity 0.5 / 1.0 (GEM_SPEC section 9), causal and non-causal;
  (c) histories of 1024 tokens plus 64 targets per sample;
  (d) window 256 on (a).
Peers, each on the masks it can express: PyTorch's varlen flash kernel (FlashAttention-2 through
``aten._flash_attention_forward/backward``), nested-tensor SDPA (jagged layout), FlexAttention with a
document mask (compiled; block-mask build time reported apart), padded SDPA (small sizes only).

FLOPs are useful work only (GEM_SPEC section 8): forward 4 H D x unmasked pairs, backward 2.5x that.
JFA is timed through its registered ops (``torch.ops.opengem.jagged_attention_fwd/bwd``: schedule lookup
included, the public function's argument validation not). Errors are relative (fp64 norms) against the
fp32 reference on the first sequences of the batch (the output of a sequence depends on it alone).

Order (a device fault poisons the CUDA context, so the riskiest code runs last): per workload JFA, then
the eager peers; FlexAttention (compiled) in a final pass over all workloads. Every step (first forward,
first backward with the error check, timed fwd / bwd / fwd+bwd) is synchronized and printed as it ends,
and ``benchmarks/results/jfa.json`` is rewritten after it, so a killed run keeps what it finished. A peer
that fails becomes a note in its row; a lost CUDA context ends the run (exit status 1, rows kept).

Run: ``PYTHONPATH=src python -m benchmarks.jfa [--quick]``. ``--quick``: workloads (a) and (d), JFA with
each kernel's default config (no autotuning), varlen flash and nested SDPA, no Flex (about 40 s cold).
Full: every workload and peer, JFA autotuned (curated configs), a few minutes. ``--workloads a_,d_``: only
the workloads whose names start so; ``--no-flex``: without the FlexAttention pass; ``--flex-workloads a_,d_``:
the FlexAttention pass on those only; ``--peers
torch_varlen_flash``: only these eager peers.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import (
    bench_ms,
    by_name_prefix,
    offsets_of,
    power_law_lengths,
    print_table,
    relative_error,
    sparsity_lengths,
    write_results,
)
from opengem.ops.jagged_attention import attention_pairs
from opengem.ops.reference.attention import jagged_attention as reference

HEADS, HEAD_DIM, DTYPE = 4, 128, torch.bfloat16
DEVICE = "cuda"
SUB_BATCH_TOKENS = 4096  # reference check on the first sequences, up to about this many tokens
FLEX_MAX_TOKENS = 700_000  # the document block mask is built over T x T (and compiled per shape)
PADDED_MAX_TOKENS = 1 << 21  # padded SDPA only while B * max_len stays small


@dataclass
class Workload:
    name: str
    lengths: torch.Tensor
    causal: bool = True
    num_targets: torch.Tensor | None = None
    window: int | None = None

    @property
    def max_len(self) -> int:
        return int(self.lengths.max())


@dataclass
class Impl:
    """One attention implementation on one workload; ``fwd_bwd`` returns (out, dq, dk, dv)."""

    name: str
    fwd: Callable[[], torch.Tensor]
    bwd: Callable[[], object]
    fwd_bwd: Callable[[], tuple[torch.Tensor, ...]]
    setup: dict | None = None


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    offsets: torch.Tensor
    targets: torch.Tensor | None
    scale: float


def _batch(wl: Workload, seed: int) -> Batch:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    total = int(wl.lengths.sum())
    q, k, v, dout = (
        torch.randn(total, HEADS, HEAD_DIM, device=DEVICE, generator=gen, dtype=DTYPE) for _ in range(4)
    )
    targets = None if wl.num_targets is None else wl.num_targets.to(DEVICE)
    return Batch(q, k, v, dout, offsets_of(wl.lengths, DEVICE), targets, 1.0 / math.sqrt(HEAD_DIM))


def _leaves(b: Batch) -> list[torch.Tensor]:
    return [t.detach().requires_grad_() for t in (b.q, b.k, b.v)]


def _autograd_impl(name: str, forward: Callable[..., torch.Tensor], b: Batch, setup: dict | None = None) -> Impl:
    """Peers differentiated by autograd: backward time = (forward + backward) - forward."""

    def fwd_bwd():
        leaves = _leaves(b)
        out = forward(*leaves)
        grads = torch.autograd.grad(out, leaves, b.dout)
        return (out.detach(), *grads)

    def fwd():
        with torch.no_grad():
            return forward(b.q, b.k, b.v)

    return Impl(name, fwd, None, fwd_bwd, setup)


def jfa_impl(wl: Workload, b: Batch) -> Impl:
    """The registered ops; ``bwd`` differentiates the latest ``fwd`` (its saved output and log-sum-exp)."""
    window = -1 if wl.window is None else wl.window
    options = (wl.max_len, wl.causal, 0, window, b.scale, True)
    forward = torch.ops.opengem.jagged_attention_fwd
    backward = torch.ops.opengem.jagged_attention_bwd
    saved: list[torch.Tensor] = []

    def fwd():
        out, lse = forward(b.q, b.k, b.v, b.offsets, b.targets, *options)
        saved[:] = [out, lse]
        return out

    def fwd_bwd():
        out, lse = forward(b.q, b.k, b.v, b.offsets, b.targets, *options)
        return (out, *backward(b.dout, b.q, b.k, b.v, out, lse, b.offsets, b.targets, *options))

    return Impl("jfa", fwd, lambda: backward(b.dout, b.q, b.k, b.v, *saved, b.offsets, b.targets, *options), fwd_bwd)


# PyTorch's flash backward (torch 2.11, H200, session 7) faulted with an illegal memory access at 4.72M
# tokens x 4 heads x 128 = 2.4e9 elements and ran at 2.36M (presumably an int32 index into its fp32 dQ
# accumulator, past 2^31). The fault poisons the CUDA context, so the peers that run it skip such sizes.
FLASH_BACKWARD_ELEMENTS_LIMIT = 2**31


def _flash_backward_fits(b: Batch) -> None:
    elements = b.q.numel()
    if elements >= FLASH_BACKWARD_ELEMENTS_LIMIT:
        raise NotImplementedError(f"flash backward faults at T*H*D = {elements} >= 2^31 (int32 dQ-accumulator index)")


def flash_impl(wl: Workload, b: Batch) -> Impl:
    """PyTorch's varlen FlashAttention-2 (cumulative int32 offsets); causal, full, or windowed.
    ``bwd`` differentiates the latest ``fwd``."""
    if wl.num_targets is not None:
        raise NotImplementedError("target mask not expressible")
    _flash_backward_fits(b)
    aten = torch.ops.aten
    window = {}
    if wl.window is not None:
        window = dict(window_size_left=wl.window, window_size_right=0 if wl.causal else wl.window)
    # schema (torch 2.5 .. 2.13): q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    # return_debug_mask, *, scale, window_size_left, window_size_right; offsets are int32 on the device
    args = (b.offsets, b.offsets, wl.max_len, wl.max_len, 0.0, wl.causal)
    saved: list = []

    def forward(q, k, v):
        return aten._flash_attention_forward(q, k, v, *args, False, scale=b.scale, **window)

    def backward(q, k, v, res):
        out, lse, rng, unused = res[0], res[1], res[2], res[3]
        return aten._flash_attention_backward(
            b.dout, q, k, v, out, lse, *args, rng, unused, scale=b.scale, **window
        )  # fmt: skip

    def fwd():
        saved[:] = [forward(b.q, b.k, b.v)]
        return saved[0][0]

    def fwd_bwd():
        res = forward(b.q, b.k, b.v)
        return (res[0], *backward(b.q, b.k, b.v, res))

    return Impl("torch_varlen_flash", fwd, lambda: backward(b.q, b.k, b.v, saved[0]), fwd_bwd)


def nested_impl(wl: Workload, b: Batch) -> Impl:
    if wl.num_targets is not None or wl.window is not None:
        raise NotImplementedError("only causal / full masks expressible")
    _flash_backward_fits(b)  # the jagged layout runs the same flash kernels
    offsets = b.offsets.long()

    def forward(q, k, v):
        nq, nk, nv = (torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(nq, nk, nv, is_causal=wl.causal, scale=b.scale)
        return out.transpose(1, 2).values()

    return _autograd_impl("nested_sdpa", forward, b)


def _document_mask_mod(wl: Workload, b: Batch):
    lengths = wl.lengths.to(DEVICE)
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=DEVICE), lengths)
    pos = torch.arange(doc.numel(), device=DEVICE) - b.offsets.long()[doc]
    hist = (lengths if b.targets is None else lengths - b.targets)[doc]
    # Flex evaluates mask_mod on whole 128-blocks: indices up to T rounded up must stay inside these
    # lookups (rows past T belong to document -1, which matches no real row)
    extra = -doc.numel() % 128
    doc, pos, hist = (F.pad(t, (0, extra), value=fill) for t, fill in ((doc, -1), (pos, 0), (hist, 0)))

    def mask_mod(batch, head, qi, ki):
        p = torch.minimum(pos[qi], hist[qi])
        visible = pos[ki] < hist[ki]
        if wl.causal:
            visible = visible & (pos[ki] <= p)
        if wl.window is not None:
            visible = visible & ((p - pos[ki]).abs() <= wl.window)
        return (doc[qi] == doc[ki]) & (visible | (qi == ki))

    return mask_mod


_FLEX = {}


def flex_impl(wl: Workload, b: Batch) -> Impl:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = b.q.shape[0]
    if total > FLEX_MAX_TOKENS:
        raise NotImplementedError(f"document block mask over {total}^2 positions too large")
    if "fn" not in _FLEX:
        for limit in ("cache_size_limit", "recompile_limit"):  # one compile per workload shape and mask
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 64)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        _FLEX["mask"] = torch.compile(create_block_mask)  # what the deprecated _compile=True did
    mask_mod = _document_mask_mod(wl, b)
    build = lambda: _FLEX["mask"](mask_mod, 1, None, total, total, device=DEVICE)  # noqa: E731
    started = time.perf_counter()
    block_mask = build()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - started) * 1e3
    setup = {"flex_block_mask_first_build_ms": first_ms, "flex_block_mask_build_ms": bench_ms(build, 5, 20)}

    def forward(q, k, v):
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return _FLEX["fn"](q4, k4, v4, block_mask=block_mask, scale=b.scale)[0].transpose(0, 1)

    return _autograd_impl("flex_attention", forward, b, setup)


def padded_impl(wl: Workload, b: Batch) -> Impl:
    if wl.num_targets is not None or wl.window is not None:
        raise NotImplementedError("only causal / full masks")
    batch, max_len = wl.lengths.numel(), wl.max_len
    if batch * max_len > PADDED_MAX_TOKENS:
        raise NotImplementedError(f"padding to {batch} x {max_len} would waste too much memory and time")
    lengths = wl.lengths.to(DEVICE)
    doc = torch.repeat_interleave(torch.arange(batch, device=DEVICE), lengths)
    pos = torch.arange(doc.numel(), device=DEVICE) - b.offsets.long()[doc]
    valid = torch.arange(max_len, device=DEVICE)[None, :] < lengths[:, None]
    key_mask = None if wl.causal else valid[:, None, None, :]  # causal: padding sits after every valid row

    def pad(t):
        out = t.new_zeros(batch, max_len, *t.shape[1:])
        out[doc, pos] = t
        return out.transpose(1, 2)

    def forward(q, k, v):
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=key_mask, is_causal=wl.causal, scale=b.scale)
        return out.transpose(1, 2)[doc, pos]

    return _autograd_impl("padded_sdpa(incl. pad/unpad)", forward, b)


def _sub_batch_rows(lengths: torch.Tensor) -> tuple[int, int]:
    """(number of leading sequences, their tokens) for the reference check."""
    count, tokens = 0, 0
    for n in lengths.tolist():
        if tokens >= SUB_BATCH_TOKENS:
            break
        count, tokens = count + 1, tokens + n
    return count, tokens


def _errors(results: tuple[torch.Tensor, ...], wl: Workload, want: list[torch.Tensor]) -> float:
    _, rows = _sub_batch_rows(wl.lengths)
    return max(relative_error(got[:rows], w) for got, w in zip(results, want))


def _reference_sub_batch(wl: Workload, b: Batch) -> list[torch.Tensor]:
    count, rows = _sub_batch_rows(wl.lengths)
    leaves = [t[:rows].float().requires_grad_() for t in (b.q, b.k, b.v)]
    targets = None if b.targets is None else b.targets[:count]
    out = reference(*leaves, b.offsets[: count + 1], wl.max_len, causal=wl.causal, num_targets=targets, window=wl.window)
    grads = torch.autograd.grad(out, leaves, b.dout[:rows].float())
    return [out.detach(), *grads]


class CudaContextLost(RuntimeError):
    """A device fault (e.g. an illegal memory access) poisoned the CUDA context: nothing after it can run."""


class Recorder:
    """The rows of this run, rewritten to ``benchmarks/results/jfa.json`` after every change, so that a run
    killed by a timeout or a device fault leaves every finished number behind."""

    def __init__(self, meta: dict):
        self.rows: list[dict] = []
        self.meta = meta

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.save()
        return row

    def save(self) -> None:
        write_results("jfa", self.rows, self.meta)


def say(text: str) -> None:
    print(text, flush=True)


def _cuda_alive() -> bool:
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001  (torch.AcceleratorError after a fault; any failure here means the same)
        return False


def _synced(fn: Callable[[], object]) -> tuple[object, float]:
    """(result, seconds) of ``fn`` with the device drained, so a fault is raised by the step that caused it."""
    started = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - started


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _measure(name: str, make: Callable[[Workload, Batch], Impl], wl: Workload, b: Batch, pairs: int,
             want: list[torch.Tensor], rec: Recorder) -> dict:  # fmt: skip
    """First calls (checked against the reference), then timed forward, backward, forward+backward; each step
    synchronized, printed and saved. A peer failing (API missing, unsupported mask) becomes a note."""
    row = rec.add({"workload": wl.name, "impl": name, "tokens": int(wl.lengths.sum()), "batch": wl.lengths.numel(),
                   "max_len": wl.max_len})  # fmt: skip
    tag = f"[{wl.name}] {name}"
    step = "setup"
    try:
        impl, row["setup_s"] = _synced(lambda: make(wl, b))
        row.update(impl.setup or {})
        if impl.setup:
            say(f"{tag}: setup ok ({row['setup_s']:.2f} s)")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step = "first forward"
        out, seconds = _synced(impl.fwd)
        say(f"{tag}: first forward ok ({seconds:.2f} s)")
        step = "first backward"
        if impl.bwd is not None:
            grads, seconds = _synced(impl.bwd)
            results = (out, *grads)
            del grads
        else:
            results, seconds = _synced(impl.fwd_bwd)
        del out
        row["peak_mem_gb"] = (torch.cuda.max_memory_allocated() - base) / 1e9
        row["max_rel_err"] = _errors(results, wl, want)
        del results
        say(f"{tag}: first backward ok ({seconds:.2f} s), max_rel_err {row['max_rel_err']:.2e}")
        rec.save()
        flops = 4 * HEADS * HEAD_DIM * pairs
        for variant, fn, work in (("fwd", impl.fwd, 1.0), ("bwd", impl.bwd, 2.5), ("fwd_bwd", impl.fwd_bwd, 3.5)):
            if fn is None:  # autograd peers: backward = (forward + backward) - forward, filled in below
                continue
            step = f"timing {variant}"
            ms = bench_ms(fn)
            torch.cuda.synchronize()
            row[f"{variant}_ms"], row[f"{variant}_tflops"] = ms, work * flops / ms / 1e9
            say(f"{tag}: {variant} {ms:.3f} ms, {row[f'{variant}_tflops']:.1f} TFLOP/s")
            rec.save()
        if impl.bwd is None:
            row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
            row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] / 1e9 if row["bwd_ms"] > 0 else None
    except NotImplementedError as err:
        row["note"] = f"skipped: {_first_line(err)}"
        say(f"{tag}: {row['note']}")
    except Exception as err:  # noqa: BLE001  (one implementation failing must not hide the others)
        row["note"] = f"error in {step}: {_first_line(err)}"
        row["error"] = f"{type(err).__name__}: {err}"[:2000]
        say(f"{tag}: {row['note']}")
        if not _cuda_alive():
            rec.save()
            raise CudaContextLost(f"{tag}, {step}: {_first_line(err)}") from err
    rec.save()
    torch.cuda.empty_cache()
    return row


def _compare(rows: list[dict]) -> None:
    """JFA's speed against the best timed peer of its workload (>1: JFA faster), and against varlen flash."""
    for jfa in (r for r in rows if r["impl"] == "jfa" and "fwd_bwd_ms" in r):
        peers = [r for r in rows if r["workload"] == jfa["workload"] and r["impl"] != "jfa" and "fwd_bwd_ms" in r]
        for metric in ("fwd", "bwd", "fwd_bwd"):
            best = max((r[f"{metric}_tflops"] or 0.0 for r in peers), default=0.0)
            jfa[f"{metric}_vs_best_peer"] = (jfa[f"{metric}_tflops"] or 0.0) / best if best else None
        flash = next((r for r in peers if r["impl"] == "torch_varlen_flash"), None)
        if flash:
            jfa["fwd_vs_flash"] = flash["fwd_ms"] / jfa["fwd_ms"]
            jfa["bwd_vs_flash"] = flash["bwd_ms"] / jfa["bwd_ms"]
    by_name = {(r["workload"], r["impl"]): r for r in rows}
    full, window = by_name.get(("a_power_law_causal", "jfa"), {}), by_name.get(("d_power_law_window256", "jfa"), {})
    if "fwd_bwd_ms" in full and "fwd_bwd_ms" in window:
        window["speedup_vs_full_causal"] = full["fwd_bwd_ms"] / window["fwd_bwd_ms"]


def tile_label(block_m: int, block_n: int, num_warps: int, num_stages: int) -> str:
    """A JFA tile as ``m{BLOCK_M}_n{BLOCK_N}_w{warps}_s{stages}``."""
    return f"m{block_m}_n{block_n}_w{num_warps}_s{num_stages}"


def config_label(config) -> str:
    """A JFA tile config as :func:`tile_label` writes it, ``_ptr`` added for dK/dV's pointer loads."""
    pointer = "_ptr" if config.kwargs.get("POINTER_LOADS") else ""
    return tile_label(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages) + pointer


def tuned_configs() -> dict[str, str]:
    """The config each JFA kernel last ran with: the autotuner's pick for the workload just measured."""
    from opengem.ops.triton import jagged_attention as kernels

    return {
        name: config_label(c)
        for name, kernel in kernels.KERNELS.items()
        if (c := getattr(kernel, "best_config", None)) is not None
    }


def run_workload(wl: Workload, peers: dict[str, Callable], rec: Recorder, seed: int = 0) -> None:
    b = _batch(wl, seed)
    pairs = attention_pairs(b.offsets, causal=wl.causal, num_targets=b.targets, window=wl.window)
    want = _reference_sub_batch(wl, b)
    torch.cuda.synchronize()
    say(f"[{wl.name}] {int(wl.lengths.sum())} tokens, B = {wl.lengths.numel()}, max_len {wl.max_len}, {pairs} pairs")
    for name, make in peers.items():
        row = _measure(name, make, wl, b, pairs, want, rec)
        if name == "jfa":
            row["tuned"] = tuned_configs()
        for r in rec.rows:
            if r["workload"] == wl.name:
                r.update(pairs=pairs, causal=wl.causal, window=wl.window, targets=wl.num_targets is not None)
        _compare(rec.rows)
        rec.save()
    del b, want
    torch.cuda.empty_cache()


def workloads(quick: bool) -> list[Workload]:
    gen = torch.Generator().manual_seed(0)
    power_law = power_law_lengths(150_000, 100, 16384, gen)
    out = [Workload("a_power_law_causal", power_law)]
    if not quick:
        for max_len in (512, 1024, 2048, 4096):
            for sparsity in (0.5, 1.0):
                lengths = sparsity_lengths(1152, max_len, sparsity, gen)
                for causal in (True, False):
                    name = f"b_L{max_len}_s{sparsity}_{'causal' if causal else 'full'}"
                    out.append(Workload(name, lengths, causal=causal))
        out.append(Workload("c_1024_hist_64_targets", torch.full((144,), 1088), num_targets=torch.full((144,), 64)))
    out.append(Workload("d_power_law_window256", power_law, window=256))
    if not quick:  # gem-large's self-attention: non-causal, window 1024 (less its 8 CLS rows)
        out.append(Workload("e_power_law_full_window1024", power_law, causal=False, window=1024))
    return out


def selected(quick: bool, prefixes: list[str] | None) -> list[Workload]:
    """The workloads whose names start with one of ``prefixes`` (all when None); an unknown prefix is an error."""
    return by_name_prefix(workloads(quick), prefixes, "--workloads")


EAGER_PEERS = ("torch_varlen_flash", "nested_sdpa", "padded_sdpa(incl. pad/unpad)")


def run(
    quick: bool, rec: Recorder, chosen: list[Workload], flex: list[Workload], peers: list[str] | None = None
) -> None:
    """Our kernel first, then the eager peers (``peers``: only these), workload by workload; FlexAttention
    (compiled, the riskiest: its device fault would poison the context) last of all, in a pass of its own."""
    names = peers if peers is not None else [n for n in EAGER_PEERS if not (quick and n.startswith("padded"))]
    makers = dict(zip(EAGER_PEERS, (flash_impl, nested_impl, padded_impl)))  # looked up now: tests swap them
    safe = {"jfa": jfa_impl, **{name: makers[name] for name in names}}
    for wl in chosen:
        run_workload(wl, safe, rec)
    for wl in flex:
        run_workload(wl, {"flex_attention": flex_impl}, rec)


COLUMNS = [
    "workload", "impl", "fwd_tflops", "bwd_tflops", "fwd_bwd_tflops", "fwd_vs_best_peer", "bwd_vs_best_peer",
    "fwd_bwd_vs_best_peer", "fwd_vs_flash", "bwd_vs_flash", "peak_mem_gb", "max_rel_err", "note",
]  # fmt: skip


def plot(rows: list[dict], path) -> bool:
    """Grouped bars of forward+backward TFLOP/s per workload and implementation (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timed = [r for r in rows if "fwd_bwd_tflops" in r]
    names = list(dict.fromkeys(r["workload"] for r in timed))
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.9), 4.5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        values = {r["workload"]: r["fwd_bwd_tflops"] for r in timed if r["impl"] == impl}
        ax.bar([x + i * width for x in range(len(names))], [values.get(n, 0.0) for n in names], width, label=impl)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("fwd+bwd TFLOP/s (useful)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="workloads (a), (d): JFA untuned, varlen flash, nested SDPA (< 75 s)"
    )
    parser.add_argument(
        "--workloads", type=lambda text: text.split(","), default=None,
        help="comma-separated name prefixes (e.g. a_,d_,b_L1024): run only those workloads",
    )
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take minutes)")
    parser.add_argument(
        "--flex-workloads", type=lambda text: text.split(","), default=None,
        help="name prefixes of the chosen workloads the FlexAttention pass times (default: all chosen)",
    )
    parser.add_argument(
        "--peers", type=lambda text: text.split(","), default=None,
        help=f"comma-separated eager peers to time beside JFA, of {list(EAGER_PEERS)} (default: all)",
    )
    args = parser.parse_args()
    chosen = selected(args.quick, args.workloads)
    unknown = [p for p in args.peers or [] if p not in EAGER_PEERS]
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}; choose from {list(EAGER_PEERS)}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.jfa needs a CUDA device")
    if args.quick:  # each kernel's default config: no autotuning on a cold start
        os.environ["OPENGEM_JFA_AUTOTUNE"] = "0"
    started = time.perf_counter()
    flex = [] if args.quick or args.no_flex else by_name_prefix(chosen, args.flex_workloads, "--flex-workloads")
    rec = Recorder({"quick": args.quick, "workloads": [wl.name for wl in chosen], "flex": [wl.name for wl in flex],
                    "peers": args.peers, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE),
                    "autotune": os.environ.get("OPENGEM_JFA_AUTOTUNE", "curated")})  # fmt: skip
    say(f"benchmarks.jfa: quick={args.quick}, autotune={rec.meta['autotune']}, {torch.cuda.get_device_name()}")
    lost = None
    try:
        run(args.quick, rec, chosen, flex, args.peers)
    except CudaContextLost as err:
        lost = str(err)
        rec.meta["aborted"] = f"CUDA context lost at {lost}"
        rec.save()
    print_table(rec.rows, COLUMNS)
    window = next((r for r in rec.rows if r.get("speedup_vs_full_causal")), None)
    if window:
        print(f"window 256 vs full causal (fwd+bwd): {window['speedup_vs_full_causal']:.2f}x")
    print("TFLOP/s count useful work only (GEM_SPEC section 8); peak 989 TFLOP/s dense bf16")
    path = write_results("jfa", rec.rows, rec.meta)
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")
    if not lost and plot(rec.rows, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
    ours_failed = any(r["impl"] == "jfa" and "fwd_bwd_ms" not in r for r in rec.rows)
    if lost or ours_failed:
        raise SystemExit(f"ABORTED: CUDA context lost at {lost}" if lost else "FAILED: a JFA measurement errored")


if __name__ == "__main__":
    main()
