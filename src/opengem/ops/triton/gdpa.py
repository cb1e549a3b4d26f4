"""GDPA host side: tile scheduling, kernel selection, tuning, launches (kernels in ``gdpa_kernels``).

Scheduling: the host reads the offsets once (the public op already does for validation), lists the
non-empty tiles as int32 ``(sample, tile)`` work items sorted by estimated K/V work, longest first, and
launches one program per (item, head). The GPU hands programs to SMs in launch order, so this is
longest-processing-time-first scheduling: the long tails start first and the short items fill the gaps.
Work lists are cached per (offsets, tile size, mask kind).

Variants: when ``max_len_k <= 256`` (and K plus V fit in 128 KiB of shared memory) the forward may keep the
whole sample's K/V resident (one key tile, loaded once) while each program loops over several Q tiles of
the sample, so Triton pipelines the next Q tile's loads under the current tile's math (short-KV
cross-attention and pooling have 1-2 key tiles: without this the prologue/epilogue dominates); those
candidates (``block_n`` 0) are timed beside the key loop's. Otherwise a program loops over key tiles.

Loads: tiles come through ragged TMA descriptors (:mod:`opengem.ops.triton.ragged_tiles`) where the
tensors allow it (16-byte aligned base and strides, sm_90+), for the passes ``OPENGEM_GDPA_TMA`` names
(default all; ``none``: masked pointer loads everywhere). JFA's forward and dQ ran 9-16% faster so (H200,
session 8). GDPA times each candidate on both load paths: session 10's tuner picked TMA for 24 of 27 keys
and pointer loads for 3 (``tuning`` in ``gdpa_a.json``, ``gdpa_bcd.json``), so both stay.

Tuning: BLOCK_M / BLOCK_N / num_warps / num_stages (and Q tiles per program) are timed once per key
(pass, mask flags, power-of-two buckets of max_len_q / max_len_k, head dim, dtype, GQA group); the
lengths themselves are runtime ints, so a new batch never recompiles within a bucket. Tuning compiles
every candidate (3 tile shapes per pass, 7 for a short-K/V forward, each with both load paths where TMA
applies); ``OPENGEM_GDPA_TUNE=0`` skips it.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal

import numpy as np
import torch
import triton
import triton.testing

from opengem.jagged.host import offsets_summary, to_device
from opengem.ops import gluon
from opengem.ops.triton.gdpa_kernels import (
    gdpa_bwd_dkdv_chunk_sum_kernel,
    gdpa_bwd_dkdv_kernel,
    gdpa_bwd_dkdv_short_q_kernel,
    gdpa_bwd_dq_broadcast_kernel,
    gdpa_bwd_dq_kernel,
    gdpa_fwd_kernel,
)
from opengem.ops.triton.jagged_attention import TUNING_BUCKET_CAP
from opengem.ops.triton.launcher import launcher
from opengem.ops.triton.ragged_tiles import last_dim_contiguous, ragged_descriptor, tma_ok, tma_passes
from opengem.ops.triton.tuning import ConfirmingAutotuner, close_finalists

SHORT_KV_MAX = 256
RESIDENT_KV_BYTES = 128 * 1024
_TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class GdpaArgs:
    """Resolved options shared by the forward and backward launches."""

    head_activations: tuple[int, ...]
    pre_scale: float
    out_scale: float
    causal: bool
    contextual_len: int
    window: int | None
    broadcast_q: bool
    max_len_q: int
    max_len_k: int

    def masked(self, num_targets: torch.Tensor | None) -> bool:
        return self.causal or num_targets is not None or self.contextual_len > 0 or self.window is not None


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tiles: int = 1
    pointer_loads: bool = False  # masked pointer loads even where the tensors allow TMA descriptors
    max_registers: int = 0  # ptxas's per-thread cap (Triton's maxnreg); 0: none
    gluon: bool = False  # the persistent Gluon forward (``opengem.ops.gluon.gdpa_forward``; its tile is fixed)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self) -> int:  # hashed once: every call's tuning key holds up to 18 candidates (~20 us a call)
        return self._hash


# Candidates for sm_90 at D = 128 (ptxas reports: no or small register spills). Each pass chains two dots, for
# which Triton puts every warp on the rows of the first dot's tile (its [num_warps, 1] Hopper MMA layout):
# rows < 16 x num_warps replicate that dot and the activation on every warpgroup (64 rows at 8 warps: twice
# the work, found in session 9 on the CPU: benchmarks.gdpa_sass), so 64-row tiles run 4 warps, 128-row 8.
# The rows are BLOCK_M in the forward and dQ, BLOCK_N in dK/dV (its tiles are transposed).
# 64 x 32 at 4 stages: the fastest forward on every (a) workload of L256-L1024 it was timed on (0.83-0.93x the
# 64 x 64 tile's time, H200, session 23: benchmarks.diag.gdpa_short_tiles), so it leads (the untuned default).
# Capped at 168 registers: three programs per SM (65,536 / (168 x 128)); fast_gelu's smoothstep took it to 177
# (two per SM) and 20% slower on (a) L256 / L512 (H200, session 24); at 168 no spills (sm_90 SASS, Triton 3.6).
_FWD = (Config(64, 32, 4, 4, max_registers=168), Config(128, 64, 8, 3), Config(128, 128, 8, 2), Config(64, 64, 4, 3))
# the persistent Gluon forward (OPENGEM_GDPA_GLUON=auto), timed after the Triton candidates (so OPENGEM_GDPA_TUNE=0
# keeps the Triton default); num_warps: a consumer partition's
_GLUON_FWD = Config(gluon.GDPA_FORWARD_BLOCK_M, gluon.GDPA_FORWARD_BLOCK_N, 4, gluon.GDPA_FORWARD_STAGES, gluon=True)
# resident K/V: one program per SM at K/V 256 (168-192 KB of shared memory), so the K/V load (128 KB) is not
# hidden behind another program's math; more Q tiles per program spread it over up to 2,048 query rows (32
# tiles: 2-3% faster than 16 on (b) K/V 256 in two runs, session 23)
_FWD_RESIDENT = (Config(128, 0, 8, 2, 2), Config(64, 0, 4, 3, 4), Config(128, 0, 8, 2, 8), Config(64, 0, 4, 3, 16),
                 Config(64, 0, 4, 3, 32))
# the backward's narrower inner tiles (Q tiles of 32 in dK/dV, key tiles of 32 in dQ), as the forward's 64 x 32:
# picked on every dK/dV key and 3 of 5 dQ keys of (a) L256 / L512 and (b) K/V 256 (session 23, 1-5% faster)
_DKDV = (Config(64, 128, 8, 2), Config(64, 64, 4, 2), Config(32, 128, 8, 2), Config(32, 64, 4, 3))
_DQ = (Config(128, 64, 8, 2), Config(64, 64, 4, 2), Config(128, 128, 8, 2), Config(64, 32, 4, 3))
# dQ with resident K/V (short K/V), query tiles pipelined as in the forward's resident candidates. sm_90, Triton 3.6:
# at 32 keys (GEM's PFFN) 64 x 4 x 3 takes 135 registers, no spills, 90 KB of shared memory. H200, session 30, same
# run: 0.19-0.22 ms against 0.30-0.35 for the best key loop on gem-large's PFFN dQ, 1.197 against 1.838 ms on (b)
# K/V 128; at K/V 256 the 64-row tile spills ~600 B and the key loop wins (2.62 ms against 4.21). A 128-row resident
# tile (8 warps, 4 tiles) lost everywhere (0.25-0.33, 1.556, 3.538 ms) and is not a candidate.
_DQ_RESIDENT = (Config(64, 0, 4, 3, 8), Config(64, 0, 4, 2, 16))
# broadcast-Q dK/dV when the shared queries fit one tile (block_m 0: the queries' own tile of up to SHORT_Q_MAX rows;
# seed pooling's 16 seeds), pointer loads, ``tiles`` key tiles a program. H200, session 30, gem-large's pooling (16
# seeds), same run: 0.254-0.292 ms against 0.368-0.438 for the best generic dK/dV (1.45-1.50x). 64 x 4 x 3 x 8 tiles
# (255 registers, spills) and 128 x 8 x 2 x 4 (180-230 KB of shared memory, over the limit at 64 seeds) were slower
# on every key and are not candidates; this one fits at up to 64 seeds (<= 205 KB, sm_90 static count).
_DKDV_SHORT_Q = (Config(0, 64, 4, 2, 16, pointer_loads=True),)
SHORT_Q_MAX = 64
# the interpreter runs on CPU: one small config that still exercises multi-tile loops (block_n 0: resident K/V)
_INTERPRET = Config(16, 16, 1, 1, 2)
_INTERPRET_RESIDENT = Config(16, 0, 1, 1, 2)
_INTERPRET_SHORT_Q = Config(0, 16, 1, 1, 2, pointer_loads=True)
_INTERPRET_MX = Config(16, 32, 1, 1, 2)  # P's MX blocks of 32 keys need key tiles of 32 or more
MX_BLOCK_KEYS = 32


PASSES = ("fwd", "dkdv", "dq")


def _tma_passes(setting: str) -> frozenset[str]:
    return tma_passes(setting, PASSES, "OPENGEM_GDPA_TMA")


# The passes whose tiles may load through ragged TMA descriptors; benchmarks and tests may reassign it.
TMA_PASSES = _tma_passes(os.environ.get("OPENGEM_GDPA_TMA", ",".join(PASSES)))


def _tma_possible(name: str, *tensors: torch.Tensor) -> bool:
    return name in TMA_PASSES and all(tma_ok(t) for t in tensors)


def tma_tile_safe(config: Config, head_dim: int, masked: bool, kv_block: int = 0) -> bool:
    """False where the TMA path computes wrong results on Triton 3.6 (sm_90): masked self-attention whose key
    tile has as many rows as the head dimension (BLOCK_N = D; ``kv_block``: the resident forward's key tile),
    in the forward and dQ (whose key tiles come through TMA).
    Measured in session 10 (``benchmarks.diag.gdpa_candidates``, every length set): forward output and dQ off
    by 0.45-1e6 relative for 128 x 128 at D 128 and for 128 x 64 and 64 x 64 at D 64; unmasked tiles, every
    dK/dV tile (its key tile is a pointer load), other tile shapes and pointer loads right. JFA's loop, which
    splits the masked tiles off instead of branching per tile, passes its masked GPU tests at D 32-256. Such
    candidates keep pointer loads."""
    block_n = kv_block if config.block_n == 0 else config.block_n
    return not (masked and block_n == head_dim)


@functools.lru_cache(maxsize=256)  # per call it rebuilt up to 14 dataclasses (host time on short batches)
def _load_paths(
    candidates: tuple[Config, ...], tma: bool, head_dim: int = 0, masked: bool = False, kv_block: int = 0
) -> tuple[Config, ...]:
    """Each candidate with TMA loads (where :func:`tma_tile_safe`), then each with pointer loads; pointer
    loads alone without TMA."""
    pointer = tuple(replace(c, pointer_loads=True) for c in candidates)
    if not tma:
        return pointer
    return (*(c for c in candidates if tma_tile_safe(c, head_dim, masked, kv_block)), *pointer)


def _tile_descriptors(config: Config, rows: Sequence[tuple[torch.Tensor, int]]) -> tuple[list, bool]:
    """Ragged descriptors of ``(tensor, box rows)`` for a TMA candidate, else the tensors themselves."""
    if config.pointer_loads:
        return [t for t, _ in rows], False
    return [ragged_descriptor(t, block) for t, block in rows], True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_triton_head_dim(head_dim: int) -> None:
    if head_dim not in _TRITON_HEAD_DIMS:
        raise ValueError(f"the Triton GDPA kernels need head_dim in {_TRITON_HEAD_DIMS}, got {head_dim}")


def _bucket(n: int) -> int:
    return min(TUNING_BUCKET_CAP, triton.next_power_of_2(max(n, 1)))  # see jagged_attention.tuning_bucket


_TUNED: dict[tuple, Config] = {}
_TIMINGS: dict[tuple, list[tuple[Config, float | None]]] = {}  # per key: each candidate's ms (None: it failed)
_CONFIRMED: dict[tuple, dict[Config, float]] = {}  # per key: the close finalists' second-look ms


def tuned_configs() -> int:
    """How many (pass, key) configurations are settled (``opengem.ops.triton.tuning.tuned_keys``)."""
    return len(_TUNED)


def tuned_key_list() -> list[tuple]:
    """The settled (pass, key) tuples, for `opengem.ops.triton.tuning.tuned_key_names`."""
    return list(_TUNED)


def tuning_report() -> list[dict]:
    """Each tuned key's candidates with their timed milliseconds and the pick, for benchmark JSON: the
    evidence to prune candidates (and load paths) by."""
    report = []
    for key, timings in _TIMINGS.items():
        pass_name, flags, broadcast, bucket_q, bucket_k = key[:5]
        report.append({
            "pass": pass_name, "broadcast_q": broadcast, "bucket_q": bucket_q, "bucket_k": bucket_k,
            "fill": list(key[9:11]),  # (q, k): _tune_key's fill buckets
            "masked": dict(flags).get("MASKED"), "pick": _label(_TUNED[key]),
            "candidates": {_label(config): ms for config, ms in timings},
            "confirmed": {_label(config): ms for config, ms in _CONFIRMED.get(key, {}).items()},
        })
    return report


def _register_cap(config: Config) -> dict:
    """The launch's ``maxnreg`` where the config caps registers (the interpreter takes no such option)."""
    return {"maxnreg": config.max_registers} if config.max_registers and not interpreting() else {}


def _label(config: Config) -> str:
    if config.gluon:
        return f"gluon_persistent_m{config.block_m}_n{config.block_n}_s{config.num_stages}"
    block_n = "resident" if config.block_n == 0 else config.block_n
    block_m = "shortq" if config.block_m == 0 else config.block_m
    loads = "ptr" if config.pointer_loads else "tma"
    cap = f"_r{config.max_registers}" if config.max_registers else ""
    return f"m{block_m}_n{block_n}_w{config.num_warps}_s{config.num_stages}_t{config.tiles}{cap}_{loads}"


def fast_activations() -> bool:
    """silu / gelu_tanh through the GPU's one-instruction tanh in 16-bit kernels (``activations`` says why);
    ``OPENGEM_GDPA_FAST_ACT=0`` keeps the exponential and reciprocal."""
    return os.environ.get("OPENGEM_GDPA_FAST_ACT", "1") != "0" and not interpreting()


GLUON_FORWARD_SETTINGS = ("auto", "off", "only")


def gluon_forward_setting() -> str:
    """``OPENGEM_GDPA_GLUON``: ``auto`` times the persistent Gluon forward beside the Triton candidates where it
    applies (:func:`gluon_forward_unsupported`), ``off`` (default) never uses it, ``only`` makes it the sole candidate
    where it applies (tests and benchmarks that must run it). Off by default: with its mended work-item read it still
    lost the tuning on every (a) row, 0.84-0.99x the best Triton candidate (H100, session 45, ``gdpa_s48a2``), so
    ``auto`` would only add its compile and timing to each tuning."""
    setting = os.environ.get("OPENGEM_GDPA_GLUON", "off")
    if setting not in GLUON_FORWARD_SETTINGS:
        raise ValueError(f"OPENGEM_GDPA_GLUON must be one of {GLUON_FORWARD_SETTINGS}, got {setting!r}")
    return setting


def gluon_forward_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, args: GdpaArgs,
                              common: dict, lengths: BatchLengths, p_mx: bool) -> str | None:
    """Why the Gluon forward cannot take this call, or None."""
    if not gluon.available(q.device):
        return "needs an sm_90 GPU and triton 3.6"
    from opengem.ops.gluon.gdpa_forward import unsupported  # imports Gluon's Hopper API, which moves between releases

    return unsupported(q, k, v, out, masked=common["constexprs"]["MASKED"], broadcast_q=args.broadcast_q,
                       uniform_activation=common["constexprs"]["ACT"] >= 0, p_mx=p_mx,
                       q_lengths=np.frombuffer(lengths.q, dtype=np.int64),
                       k_lengths=np.frombuffer(lengths.k, dtype=np.int64))


def query_chunks_enabled() -> bool:
    """``OPENGEM_GDPA_QUERY_CHUNKS=0`` keeps one dK/dV program a key tile however long its sample (an A/B switch)."""
    return os.environ.get("OPENGEM_GDPA_QUERY_CHUNKS", "1") != "0"


WORK_ORDERS = ("work", "keys")


def work_order_setting() -> str:
    """``OPENGEM_GDPA_WORK_ORDER``: how :func:`_work_order` sorts the tiles. ``keys`` (default): by the keys a tile
    visits, as JFA orders its tiles (ties: the longer sample first, :func:`_ranked`), so an unmasked sample's tiles
    (its partial last one included) stay adjacent and read its K/V while L2 still holds it; ``work``: by rows x keys,
    which runs a sample's partial last tile long after its full ones (H100, issue 4's (a) forward at sparsity 0.5:
    ``keys`` 1.04-1.26x ``work``, the same bits; session 46, ``gdpa_work_order_s50a``). Read at every op call; a
    tuned tile keeps its pick whichever order it was timed in. It orders every pass's list, dK/dV split into query
    chunks (:func:`_query_chunked_work`) included."""
    setting = os.environ.get("OPENGEM_GDPA_WORK_ORDER", "keys")
    if setting not in WORK_ORDERS:
        raise ValueError(f"OPENGEM_GDPA_WORK_ORDER must be one of {WORK_ORDERS}, got {setting!r}")
    return setting


def tuning_enabled() -> bool:
    """``OPENGEM_GDPA_TUNE=0`` uses each pass's first fitting candidate (no timing, 1 compile per variant)."""
    return os.environ.get("OPENGEM_GDPA_TUNE", "1") != "0"


def _tuned(key: tuple, candidates: Sequence[Config], launch: Callable[[Config], None]) -> Config:
    """The fastest candidate for ``key`` (tuned once); candidates that fail to compile or fit are skipped.

    Every candidate is timed in one short window, then the close finalists again in the long window a training step
    runs them in, as :class:`~opengem.ops.triton.tuning.ConfirmingAutotuner` does for JFA (its ``finalists``,
    ``margin`` and ``confirm_window_ms``; ``finalists = 1`` keeps the one window): on a power-capped card the short
    window ranks close tiles unreliably (issue 4's (a) L1024 s1.0 forward, H100, session 46: one run's short window
    put 64 x 64 1.4% ahead of 64 x 32; in another run the long window timed 64 x 64 24% slower). With tuning off: the
    first candidate that compiles and fits (e.g. D = 256 may not fit the first).
    """
    if interpreting():
        return candidates[0]
    tune = tuning_enabled()
    key = key + (tuple(candidates), tune)
    if key not in _TUNED:
        best, best_ms, error, timings = None, math.inf, None, []
        for config in candidates:
            try:
                if not tune:
                    launch(config)
                    best = config
                    break
                ms = triton.testing.do_bench(lambda: launch(config), warmup=5, rep=20)
            except Exception as exc:  # a config may exceed shared memory or registers: try the next one
                error = exc
                timings.append((config, None))
                continue
            timings.append((config, ms))
            if ms < best_ms:
                best, best_ms = config, ms
        if best is None:
            raise RuntimeError(f"no GDPA kernel configuration ran for {key}") from error
        if tune:
            _TIMINGS[key] = timings
            _CONFIRMED[key] = _second_look(timings, launch)
            if _CONFIRMED[key]:
                best = min(_CONFIRMED[key], key=_CONFIRMED[key].get)
        _TUNED[key] = best
    return _TUNED[key]


def _second_look(timings: list[tuple[Config, float | None]], launch: Callable[[Config], None]) -> dict[Config, float]:
    """The close finalists of a first look timed again in the long window (:func:`_tuned`); empty for a clear
    winner. A finalist that fails this time (it ran in the first look) drops out."""
    first = {config: math.inf if ms is None else ms for config, ms in timings}
    warmup_ms, rep_ms = ConfirmingAutotuner.confirm_window_ms
    second = {}
    for config in close_finalists(first, ConfirmingAutotuner.finalists, ConfirmingAutotuner.margin):
        try:
            second[config] = triton.testing.do_bench(lambda: launch(config), warmup=warmup_ms, rep=rep_ms)
        except Exception:  # e.g. memory taken meanwhile: the finalists that ran decide
            continue
    return second


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(owner, index)`` of ``counts.sum()`` entries: entry ``i`` is number ``index[i]`` of ``owner[i]``'s
    ``counts[owner[i]]`` (tiles of a sample, chunks of a tile)."""
    owner = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    return owner, np.arange(owner.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def _work_order(rows: np.ndarray, cols: np.ndarray, block: int, tiles: int, kind: str,
                window: int, order: str) -> tuple[np.ndarray, np.ndarray]:
    """(sample, first tile) int64 items over the tiles of ``rows``, sorted by estimated work, longest first.

    ``kind``: ``"full"`` (work = other side's length), ``"causal_q"`` (query tile sees keys up to its end),
    ``"causal_k"`` (key tile seen by the rows from its start on); ``window > 0`` caps the work. ``order``: how
    items rank (:func:`_ranked`).
    """
    step = block * tiles
    sample, first = _expand((rows + step - 1) // step)
    start = first * step
    span = np.minimum(rows[sample] - start, step)
    other = cols[sample]
    if kind == "causal_q":
        other = np.minimum(other, start + span)
    elif kind == "causal_k":
        other = np.maximum(other - start, 0)
    if window > 0:
        other = np.minimum(other, 2 * window + step)
    ranked = _ranked(span, other, rows[sample], order)
    return sample[ranked], first[ranked] * tiles


def _ranked(rows: np.ndarray, other: np.ndarray, sample_rows: np.ndarray, order: str) -> np.ndarray:
    """Indices of the work items, heaviest first (:data:`WORK_ORDERS`), each item with ``rows`` of its own, ``other``
    of the other side's it visits and ``sample_rows`` in its sample. ``work``: by ``rows`` x ``other``. ``keys``: by
    ``other``, then by ``sample_rows``; where the other side is alike for all samples (PFFN's 32 keys, pooling's
    seeds), ``other`` alone left the items in sample order, no longest first (gem-large's PFFN forward: 9-11% slower
    than ``work``, H100, session 47). Remaining ties keep sample order, so an unmasked sample's items stay in a row."""
    if order not in WORK_ORDERS:
        raise ValueError(f"work order must be one of {WORK_ORDERS}, got {order!r}")
    if order == "work":
        return np.argsort(-(rows * np.maximum(other, 1)), kind="stable")
    return np.lexsort((-sample_rows, -np.maximum(other, 1)))  # stable; the last key sorts first


@functools.lru_cache(maxsize=256)
def _work_list(
    rows_bytes: bytes, cols_bytes: bytes, block: int, tiles: int, kind: str, window: int, device: str,
    order: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_work_order`'s items as int32 device tensors (sample, first tile)."""
    sample, first = _work_order(np.frombuffer(rows_bytes, dtype=np.int64), np.frombuffer(cols_bytes, dtype=np.int64),
                                block, tiles, kind, window, order)
    return (to_device(torch.from_numpy(sample.astype(np.int32)), device),
            to_device(torch.from_numpy(first.astype(np.int32)), device))


@functools.lru_cache(maxsize=256)
def gluon_work_items(q_bytes: bytes, k_bytes: bytes, q_first: int, k_first: int, block_m: int,
                     device: str, order: str) -> torch.Tensor:
    """The Gluon forward's int32 ``[items, 4]`` table, one row a query tile, longest first as :func:`_work_list`:
    ``(first query row, query rows from it to the sample's end, first key row, keys)``; its programs read each row's
    four numbers in one round of independent loads, where (sample, tile) and the offsets would take two dependent
    rounds (the consumers wait on them before every tile's first MMA)."""
    q_len, k_len = np.frombuffer(q_bytes, dtype=np.int64), np.frombuffer(k_bytes, dtype=np.int64)
    sample, first = _work_order(q_len, k_len, block_m, 1, "full", 0, order)
    q_start = q_first + np.cumsum(q_len) - q_len
    k_start = k_first + np.cumsum(k_len) - k_len
    m_start = first * block_m
    table = np.stack([q_start[sample] + m_start, q_len[sample] - m_start, k_start[sample], k_len[sample]], axis=1)
    return to_device(torch.from_numpy(np.ascontiguousarray(table, dtype=np.int32)), device)


# The shortest query chunk, in query tiles: shorter chunks would cost more in their partial tiles' fp32 round trip
# (2 x BLOCK_N x D x 4 bytes a program, written then read by the chunk sum) than they balance.
QUERY_CHUNK_MIN_TILES = 8


@functools.lru_cache(maxsize=256)
def query_chunk_rows(q_lengths: bytes, k_lengths: bytes, block_m: int, block_n: int, kv_heads: int, sms: int) -> int:
    """The most query rows one dK/dV program walks: the pass's work (query rows x key tiles x K/V heads) over two
    programs an SM, in whole query tiles. A longer sample's key tiles are split into chunks of query rows, so no
    program outlasts the SMs' average share (gem-large's PFFN: its longest sample, ~5% of the tokens, held the pass at
    1.7x the time of the same tokens in equal-length samples; H200, session 30)."""
    q_len = np.frombuffer(q_lengths, dtype=np.int64)
    key_tiles = (np.frombuffer(k_lengths, dtype=np.int64) + block_n - 1) // block_n
    share = int((q_len * key_tiles).sum()) * kv_heads // max(1, 2 * sms)
    return max(QUERY_CHUNK_MIN_TILES, triton.cdiv(share, block_m)) * block_m


@dataclass(frozen=True)
class QueryChunks:
    """dK/dV work with long samples' query rows in chunks (``gdpa_bwd_dkdv_kernel``'s ``QUERY_CHUNKS``): per item
    ``(sample, key tile)`` and ``bounds = (lo, hi, slot)`` (int32 ``[items, 3]``; slot -1: the whole sample, stored
    directly), and per chunked key tile ``groups = (first dK row, rows, first slot, chunks)`` (int32 ``[groups, 4]``)
    for ``gdpa_bwd_dkdv_chunk_sum_kernel``."""

    work_b: torch.Tensor
    work_t: torch.Tensor
    bounds: torch.Tensor
    groups: torch.Tensor
    slots: int


@functools.lru_cache(maxsize=256)
def _query_chunked_work(
    k_lengths: bytes, q_lengths: bytes, k_first: int, block_n: int, chunk_rows: int, device: str, order: str
) -> QueryChunks | None:
    """The dK/dV items over key tiles as :func:`_work_list` (``"full"``) makes them, with each sample of more than
    ``chunk_rows`` query rows split into chunks of them, sorted as ``order`` sorts (:func:`_ranked`: a chunk's
    other side is its query rows); None when no sample is that long."""
    k_len = np.frombuffer(k_lengths, dtype=np.int64)
    q_len = np.frombuffer(q_lengths, dtype=np.int64)
    sample, tile = _expand((k_len + block_n - 1) // block_n)  # per (sample, key tile) pair
    chunks = np.maximum(1, -(-q_len[sample] // chunk_rows))
    if chunks.size == 0 or chunks.max() <= 1:
        return None
    chunked = chunks > 1
    slot_counts = np.where(chunked, chunks, 0)
    first_slot = np.cumsum(slot_counts) - slot_counts
    pair, chunk = _expand(chunks)  # per item
    in_chunks = chunked[pair]
    lo = chunk * chunk_rows
    hi = np.where(in_chunks, lo + chunk_rows, np.iinfo(np.int32).max)
    slot = np.where(in_chunks, first_slot[pair] + chunk, -1)
    key_rows = np.minimum(k_len[sample] - tile * block_n, block_n)
    query_rows = np.minimum(q_len[sample][pair] - lo, np.where(in_chunks, chunk_rows, q_len[sample][pair]))
    ranked = _ranked(key_rows[pair], query_rows, k_len[sample][pair], order)
    row_starts = k_first + np.concatenate(([0], np.cumsum(k_len)))[sample] + tile * block_n
    groups = np.stack([row_starts, key_rows, first_slot, chunks], axis=1)[chunked]

    def int32(array: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(array).astype(np.int32)), device)

    return QueryChunks(int32(sample[pair][ranked]), int32(tile[pair][ranked]),
                       int32(np.stack([lo, hi, slot], axis=1)[ranked]), int32(groups), int(slot_counts.sum()))


@functools.lru_cache(maxsize=32)
def _head_activation_tensor(ids: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int32, device=device)


def _common(q: torch.Tensor, args: GdpaArgs, num_targets: torch.Tensor | None, dummy: torch.Tensor) -> dict:
    """Kernel arguments and constexprs shared by every pass."""
    ids = args.head_activations
    uniform = all(i == ids[0] for i in ids)
    return dict(
        head_act=dummy if uniform else _head_activation_tensor(ids, str(q.device)),
        targets=dummy if num_targets is None else num_targets,
        constexprs=dict(
            ACT=ids[0] if uniform else -1,
            MASKED=args.masked(num_targets),
            CAUSAL=args.causal,
            HAS_TARGETS=num_targets is not None,
            HAS_WINDOW=args.window is not None,
            HAS_CONTEXT=args.contextual_len > 0,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            FAST_ACT=q.dtype != torch.float32 and fast_activations(),
        ),
    )


def _broadcast_len(q: torch.Tensor, args: GdpaArgs) -> int:
    """The shared query length of broadcast-Q, else 0: a jagged q's token count changes every batch, and
    an int argument that changes its divisibility by 16 makes Triton compile a new specialization (two
    GDPA kernels loaded in a timed gem-large step on an H200: a 1.75 s step)."""
    return q.shape[0] if args.broadcast_q else 0


@dataclass(frozen=True)
class BatchLengths:
    """Per-sample query and key lengths as int64 bytes (``_work_list``'s cache key; from the host mirrors'
    summaries), how full each side's grid is, and each side's first offset (broadcast-Q: 0)."""

    q: bytes
    k: bytes
    fill_q: str
    fill_k: str
    q_first: int
    k_first: int


def _batch_lengths(q_offsets: torch.Tensor, k_offsets: torch.Tensor, args: GdpaArgs) -> BatchLengths:
    k_summary = offsets_summary(k_offsets)
    batch = k_summary.lengths.size
    if args.broadcast_q:
        q_len, q_tokens, q_first = np.full_like(k_summary.lengths, args.max_len_q), batch * args.max_len_q, 0
    else:
        q_summary = offsets_summary(q_offsets)
        q_len, q_tokens, q_first = q_summary.lengths, q_summary.last - q_summary.first, q_summary.first
    return BatchLengths(q_len.tobytes(), k_summary.lengths.tobytes(), fill_bucket(q_tokens, batch, args.max_len_q),
                        fill_bucket(k_summary.last - k_summary.first, batch, args.max_len_k), q_first,
                        k_summary.first)


def fill_bucket(tokens: int, batch: int, max_len: int) -> str:
    """``"full"`` when ``batch`` sequences of ``tokens`` in all fill at least 3/4 of the ``[B, max_len]`` grid,
    else ``"ragged"``. Batches of one max_len bucket but different fill want different tiles (session 10: L1024
    at sparsity 1.0 ran 64 x 64, the sparsity-0.5 pick, at 433.8 TFLOP/s against 451.8 for 128 x 64); so the
    tuning key carries the fill."""
    return "full" if batch and tokens >= 0.75 * batch * max(max_len, 1) else "ragged"


def _tune_key(name: str, q: torch.Tensor, k: torch.Tensor, args: GdpaArgs, common: dict,
              lengths: BatchLengths) -> tuple:  # fmt: skip
    flags = tuple(sorted(common["constexprs"].items()))
    return (name, flags, args.broadcast_q, _bucket(args.max_len_q), _bucket(args.max_len_k), q.shape[2],
            q.dtype, q.shape[1] // k.shape[1], str(q.device), lengths.fill_q, lengths.fill_k)


def gdpa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    args: GdpaArgs,
    out: torch.Tensor | None = None,
    p_mx: bool = False,
) -> torch.Tensor:
    """Forward; ``out`` (optional, ``[Tq or B * Lq, H, D]``) is fully overwritten; ``p_mx``: P quantized to
    MX-E4M3 before ``P V`` (the MXFP8 forward, on operands the caller quantized)."""
    check_triton_head_dim(q.shape[2])
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    batch = k_offsets.numel() - 1
    heads, head_dim = q.shape[1], q.shape[2]
    rows_out = batch * q.shape[0] if args.broadcast_q else q.shape[0]
    if out is None:
        out = torch.empty((rows_out, heads, head_dim), dtype=q.dtype, device=q.device)
    common = _common(q, args, num_targets, k_offsets)
    lengths = _batch_lengths(q_offsets, k_offsets, args)
    masked = common["constexprs"]["MASKED"]
    interpret = interpreting()
    kv_block, resident_fits = _resident_kv(args, head_dim, q.element_size(), MX_BLOCK_KEYS if p_mx else 16)
    kind = "causal_q" if masked and args.causal else "full"
    tma = _tma_possible("fwd", q, k, v)
    order = work_order_setting()  # once a call: every launch (the tuner's too) lists its tiles in one order

    def launch(config: Config) -> None:
        if config.gluon:
            from opengem.ops.gluon.gdpa_forward import gdpa_forward as gluon_forward

            items = gluon_work_items(lengths.q, lengths.k, lengths.q_first, lengths.k_first, config.block_m,
                                     str(q.device), order)
            gluon_forward(q, k, v, out, items, common["constexprs"]["ACT"], common["constexprs"]["FAST_ACT"],
                          args.pre_scale, args.out_scale, block_n=config.block_n, stages=config.num_stages)
            return
        resident = config.block_n == 0  # the resident-K/V candidates: one key tile of the whole sample
        block_n = kv_block if resident else config.block_n
        work_b, work_t = _work_list(lengths.q, lengths.k, config.block_m, config.tiles if resident else 1, kind,
                                    args.window or 0, str(q.device), order)
        if work_b.numel() == 0:
            return
        descs, use_tma = _tile_descriptors(config, ((q, config.block_m), (k, block_n), (v, block_n)))
        launcher(gdpa_fwd_kernel)[(work_b.numel() * heads,)](
            q, k, v, out, q_offsets, k_offsets, common["targets"], common["head_act"], work_b, work_t, *descs,
            *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2],
            heads, args.pre_scale, args.out_scale, args.contextual_len, args.window or 0, _broadcast_len(q, args),
            GROUP=heads // k.shape[1], D=head_dim, BLOCK_M=config.block_m, BLOCK_N=block_n,
            TILES=config.tiles if resident else 1, BROADCAST_Q=args.broadcast_q, KV_RESIDENT=resident,
            USE_TMA=use_tma, num_warps=config.num_warps, num_stages=config.num_stages, **common["constexprs"],
            P_MX=p_mx, EXACT=interpret, **_register_cap(config),
        )

    if interpret:
        interpreter_config = _INTERPRET_RESIDENT if resident_fits else (_INTERPRET_MX if p_mx else _INTERPRET)
        config = _load_paths((interpreter_config,), tma, head_dim, masked, kv_block)[0]
    else:
        # resident K/V takes 168-224 KB of shared memory at K/V 256, D 128 (sm_90): one program per SM, so
        # the key loop's candidates (two per SM at 64 x 64) are timed beside it
        candidates = _load_paths((*_FWD_RESIDENT, *_FWD) if resident_fits else _FWD, tma, head_dim, masked, kv_block)
        setting = gluon_forward_setting()
        if setting != "off" and gluon_forward_unsupported(q, k, v, out, args, common, lengths, p_mx) is None:
            candidates = (_GLUON_FWD,) if setting == "only" else (*candidates, _GLUON_FWD)
        config = _tuned(_tune_key("fwd", q, k, args, common, lengths) + (resident_fits, p_mx), candidates, launch)
    launch(config)
    return out


def _whole_sample_tile(max_len: int, min_block: int = 16) -> int:
    """Rows of a tile that holds a whole sample's ``max_len`` rows (a power of two, at least ``min_block``)."""
    return max(min_block, triton.next_power_of_2(max(max_len, 1)))


def _resident_kv(args: GdpaArgs, head_dim: int, element_size: int, min_block: int = 16) -> tuple[int, bool]:
    """``(kv_block, fits)``: the key tile that holds a whole sample's K/V, and whether K plus V may stay resident in
    shared memory (short K/V, at most 128 KiB for both, leaving room for the pipelined query tiles)."""
    kv_block = _whole_sample_tile(args.max_len_k, min_block)
    return kv_block, args.max_len_k <= SHORT_KV_MAX and 2 * kv_block * head_dim * element_size <= RESIDENT_KV_BYTES


def gdpa_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    args: GdpaArgs,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``; ``grads`` (optional preallocated outputs) are fully overwritten."""
    dq, dk, dv, _ = _backward(grad_out, q, k, v, q_offsets, k_offsets, num_targets, args, grads, None)
    return dq, dk, dv


def gdpa_backward_with_column_sums(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    args: GdpaArgs,
    which: Literal["q", "kv"],
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gdpa_backward`, plus fp32 column sums over the tokens, the gradient of a bias their projection added:
    of dq (``which="q"``, ``[H, D]``; not for broadcast queries) or of dk and dv (``"kv"``, ``[2, H_kv, D]``). The dQ
    or dK/dV programs write their tiles' sums to a row each of a buffer sized by the final launch's work list, summed
    once after: deterministic, and no pass over the written gradients (a ``[T, H D]`` read per bias)."""
    if which not in ("q", "kv"):
        raise ValueError(f"which must be 'q' or 'kv', got {which!r}")
    if which == "q" and args.broadcast_q:
        raise ValueError("broadcast queries are shared by every sample: their column sums are not taken")
    return _backward(grad_out, q, k, v, q_offsets, k_offsets, num_targets, args, grads, which)


def _backward(grad_out, q, k, v, q_offsets, k_offsets, num_targets, args: GdpaArgs, grads, which: str | None):
    check_triton_head_dim(q.shape[2])
    q, k, v, grad_out = (last_dim_contiguous(t) for t in (q, k, v, grad_out))
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    common = _common(q, args, num_targets, k_offsets)
    lengths = _batch_lengths(q_offsets, k_offsets, args)
    masked = common["constexprs"]["MASKED"]
    scalars = (args.contextual_len, args.window or 0)
    tma_dkdv = _tma_possible("dkdv", q, grad_out)
    tma_dq = not args.broadcast_q and _tma_possible("dq", q, k, v, grad_out)  # broadcast-Q dQ: pointer loads
    order = work_order_setting()

    q_block = _whole_sample_tile(args.max_len_q)
    short_q = args.broadcast_q and q_block <= SHORT_Q_MAX  # seed pooling: every sample's queries one tile
    sums: dict[str, torch.Tensor] = {}  # the last launch's per-program column sums (the tuner's launches come first)

    def sums_buffer(name: str, programs: int, rows: tuple[int, ...]) -> torch.Tensor:
        """``[programs, *rows]`` fp32 for the launch's programs to fill when ``which`` is ``name``, else a dummy."""
        if which != name:
            return grad_out
        buffer = torch.empty((programs, *rows), dtype=torch.float32, device=q.device)
        sums[name] = buffer
        return buffer

    def launch_dkdv(config: Config) -> None:
        if config.block_m == 0:  # the short-query candidates: key tiles pipelined against one query tile
            launch_dkdv_short_q(config)
            return
        chunks = None
        if not masked and query_chunks_enabled():  # (masked passes keep one program a key tile: the mask's work)
            chunk_rows = query_chunk_rows(lengths.q, lengths.k, config.block_m, config.block_n, kv_heads,
                                          _num_sms(q.device))
            chunks = _query_chunked_work(lengths.k, lengths.q, offsets_summary(k_offsets).first, config.block_n,
                                         chunk_rows, str(q.device), order)
        if chunks is not None:
            work_b, work_t = chunks.work_b, chunks.work_t
            partial = torch.empty((chunks.slots, 2, config.block_n, kv_heads, head_dim), dtype=torch.float32,
                                  device=q.device)
        else:
            work_b, work_t = _work_list(lengths.k, lengths.q, config.block_n, 1,
                                        "causal_k" if masked and args.causal else "full", args.window or 0,
                                        str(q.device), order)
            partial = grad_out
        if work_b.numel() == 0:
            return
        descs, use_tma = _tile_descriptors(config, ((q, config.block_m), (grad_out, config.block_m)))
        programs = work_b.numel() * kv_heads
        launcher(gdpa_bwd_dkdv_kernel)[(programs,)](
            q, k, v, grad_out, dk, dv, q_offsets, k_offsets, common["targets"], common["head_act"], work_b, work_t,
            *descs, sums_buffer("kv", programs, (2, head_dim)), work_b if chunks is None else chunks.bounds, partial,
            *q.stride()[:2], *k.stride()[:2], *v.stride()[:2],
            *grad_out.stride()[:2], *dk.stride()[:2], *dv.stride()[:2],
            kv_heads, args.pre_scale, args.out_scale, *scalars, _broadcast_len(q, args),
            GROUP=group, D=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BROADCAST_Q=args.broadcast_q,
            USE_TMA=use_tma, COLUMN_SUMS=which == "kv", QUERY_CHUNKS=chunks is not None, num_warps=config.num_warps,
            num_stages=config.num_stages, **common["constexprs"],
        )
        if chunks is not None:
            launcher(gdpa_bwd_dkdv_chunk_sum_kernel)[(chunks.groups.shape[0] * kv_heads,)](
                partial, dk, dv, chunks.groups, *dk.stride()[:2], *dv.stride()[:2], kv_heads,
                BLOCK_N=config.block_n, D=head_dim, num_warps=4,
            )

    def launch_dkdv_short_q(config: Config) -> None:
        work_b, work_t = _work_list(lengths.k, lengths.q, config.block_n, config.tiles, "full", 0, str(q.device), order)
        if work_b.numel() == 0:
            return
        programs = work_b.numel() * kv_heads
        launcher(gdpa_bwd_dkdv_short_q_kernel)[(programs,)](
            q, k, v, grad_out, dk, dv, q_offsets, k_offsets, common["head_act"], work_b, work_t,
            sums_buffer("kv", programs, (2, head_dim)),
            *q.stride()[:2], *k.stride()[:2], *v.stride()[:2],
            *grad_out.stride()[:2], *dk.stride()[:2], *dv.stride()[:2],
            kv_heads, args.pre_scale, args.out_scale, _broadcast_len(q, args),
            GROUP=group, D=head_dim, BLOCK_M=q_block, BLOCK_N=config.block_n, TILES=config.tiles,
            ACT=common["constexprs"]["ACT"], BROADCAST_Q=args.broadcast_q, PRECISION=common["constexprs"]["PRECISION"],
            FAST_ACT=common["constexprs"]["FAST_ACT"], COLUMN_SUMS=which == "kv", num_warps=config.num_warps,
            num_stages=config.num_stages,
        )

    kv_block, resident_fits = _resident_kv(args, head_dim, q.element_size())
    resident_fits = resident_fits and not args.broadcast_q  # the broadcast dQ has its own kernel

    def launch_dq(config: Config) -> None:
        if args.broadcast_q:
            _launch_dq_broadcast(config, grad_out, q, k, v, k_offsets, lengths.k, dq, args, common)
            return
        resident = config.block_n == 0  # the resident-K/V candidates: one key tile of the whole sample
        block_m, block_n = config.block_m, kv_block if resident else config.block_n
        tiles = config.tiles if resident else 1
        kind = "causal_q" if masked and args.causal else "full"
        work_b, work_t = _work_list(lengths.q, lengths.k, block_m, tiles, kind, args.window or 0, str(q.device), order)
        if work_b.numel() == 0:
            return
        descs, use_tma = _tile_descriptors(config, ((q, block_m), (k, block_n), (v, block_n), (grad_out, block_m)))
        programs = work_b.numel() * heads
        launcher(gdpa_bwd_dq_kernel)[(programs,)](
            q, k, v, grad_out, dq, q_offsets, k_offsets, common["targets"], common["head_act"], work_b, work_t, *descs,
            sums_buffer("q", programs, (head_dim,)),
            *q.stride()[:2], *k.stride()[:2], *v.stride()[:2],
            *grad_out.stride()[:2], *dq.stride()[:2],
            heads, args.pre_scale, args.out_scale * args.pre_scale, *scalars,
            GROUP=group, D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, USE_TMA=use_tma, KV_RESIDENT=resident,
            TILES=tiles, COLUMN_SUMS=which == "q", num_warps=config.num_warps, num_stages=config.num_stages,
            **common["constexprs"],
        )

    if interpreting():
        launch_dkdv(_INTERPRET_SHORT_Q if short_q else _load_paths((_INTERPRET,), tma_dkdv)[0])
        dq_config = _INTERPRET_RESIDENT if resident_fits else _INTERPRET
        launch_dq(_load_paths((dq_config,), tma_dq, head_dim, masked, kv_block)[0])
    else:
        # dK/dV loads its key tile through pointers, so every tile of it stays right on TMA (tma_tile_safe)
        # the column-sum variants are tuned apart: their epilogue may not fit where the plain one does
        dkdv_key = _tune_key("dkdv", q, k, args, common, lengths) + (short_q, which == "kv")
        dkdv_candidates = (*_DKDV_SHORT_Q, *_load_paths(_DKDV, tma_dkdv)) if short_q else _load_paths(_DKDV, tma_dkdv)
        launch_dkdv(_tuned(dkdv_key, dkdv_candidates, launch_dkdv))
        dq_candidates = _load_paths((*_DQ_RESIDENT, *_DQ) if resident_fits else _DQ, tma_dq, head_dim, masked, kv_block)
        dq_key = _tune_key("dq", q, k, args, common, lengths) + (resident_fits, which == "q")
        launch_dq(_tuned(dq_key, dq_candidates, launch_dq))
    if which is None:
        return dq, dk, dv, None
    shape = (heads, head_dim) if which == "q" else (kv_heads, 2, head_dim)
    total = sums[which].view(-1, *shape).sum(0) if which in sums else q.new_zeros(shape, dtype=torch.float32)
    return dq, dk, dv, total if which == "q" else total.transpose(0, 1)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _launch_dq_broadcast(
    config: Config,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_offsets: torch.Tensor,
    k_lengths: bytes,
    dq: torch.Tensor,
    args: GdpaArgs,
    common: dict,
) -> None:
    """Broadcast-Q dQ: per-chunk fp32 partial sums over equal ranges of the flat key rows, then one ``torch.sum``
    over the chunks (``k_lengths``: the samples' key lengths as int64 bytes, ``BatchLengths.k``). The chunking depends
    only on shapes, the config and the device, and neither step uses atomics, so dQ is bitwise reproducible. (Chunks
    of equal sample counts left gem-large's pooling dQ waiting on the chunk holding its longest sample: 0.27-0.30 ms
    against 0.13-0.15 for the same tokens in equal-length samples, H200, session 30,
    ``benchmarks.diag.gdpa_gem_layers``.)"""
    summary = offsets_summary(k_offsets)
    tokens = summary.last - summary.first
    seeds, heads, head_dim = q.shape
    if tokens == 0 or seeds == 0:
        dq.zero_()
        return
    num_q_tiles = triton.cdiv(seeds, config.block_m)
    target = max(1, triton.cdiv(4 * _num_sms(q.device), num_q_tiles * heads))
    keys_per_chunk = max(config.block_n, triton.cdiv(tokens, target))
    chunks = triton.cdiv(tokens, keys_per_chunk)
    chunk_samples = key_chunks(k_lengths, summary.first, keys_per_chunk, chunks, str(q.device))
    partial = torch.empty((chunks, seeds, heads, head_dim), dtype=torch.float32, device=q.device)
    launcher(gdpa_bwd_dq_broadcast_kernel)[(chunks * num_q_tiles * heads,)](
        q, k, v, grad_out, partial, k_offsets, common["head_act"], chunk_samples,
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2],
        *grad_out.stride()[:2], partial.stride(0), partial.stride(1), partial.stride(2),
        heads, num_q_tiles, summary.first, keys_per_chunk, seeds, args.pre_scale, args.out_scale * args.pre_scale,
        GROUP=heads // k.shape[1], D=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        ACT=common["constexprs"]["ACT"], PRECISION=common["constexprs"]["PRECISION"],
        FAST_ACT=common["constexprs"]["FAST_ACT"],
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    dq.copy_(partial.sum(dim=0))


@functools.lru_cache(maxsize=256)
def key_chunks(lengths_bytes: bytes, first: int, keys_per_chunk: int, chunks: int, device: str) -> torch.Tensor:
    """int32 ``[2 * chunks]``: per chunk of ``keys_per_chunk`` flat key rows from ``first``, the samples ``[lo, hi)``
    whose rows meet it (empty samples between them included: they add nothing)."""
    lengths = np.frombuffer(lengths_bytes, dtype=np.int64)
    offsets = first + np.concatenate(([0], np.cumsum(lengths)))
    starts = first + np.arange(chunks, dtype=np.int64) * keys_per_chunk
    lo = np.searchsorted(offsets[1:], starts, side="right")  # the first sample ending after the chunk's start
    hi = np.searchsorted(offsets[:-1], starts + keys_per_chunk, side="left")  # the first starting at or after its end
    return to_device(torch.from_numpy(np.stack([lo, hi], axis=1).reshape(-1).astype(np.int32)), device)
