"""The BlockAttention benchmark on CPU (tiny shapes, reference op, event timing stubbed): its control flow
and timing columns, and the FlexAttention peer's BlockMask (tile lists, mask_mod, output vs the reference)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from benchmarks import block_attention as ba
from benchmarks import common
from opengem.ops.reference import block_attention as reference

LENGTHS = torch.tensor([21, 3, 70, 130])


@pytest.fixture
def cpu_bench(monkeypatch, tmp_path):
    monkeypatch.setattr(ba, "DEVICE", "cpu")
    monkeypatch.setattr(ba, "HEADS", 2)
    monkeypatch.setattr(ba, "HEAD_DIM", 16)
    monkeypatch.setattr(ba, "D_MODEL", 32)
    monkeypatch.setattr(ba, "DTYPE", torch.float32)
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(ba, "bench_ms", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(ba, "copy_bandwidth_gbps", lambda: 100.0)
    monkeypatch.setattr(ba, "workloads", lambda quick: [("tiny", LENGTHS)])
    monkeypatch.setattr(ba, "pin_default_configs", lambda: None)
    return tmp_path / "block_attention.json"


def test_quick_run_on_cpu_times_eagerly(cpu_bench):
    rows = ba.run(quick=True)
    timed = [r for r in rows if r["direction"] in ("fwd", "bwd")]
    assert {r["method"] for r in timed} >= {"ours", "ours+pos_rope", "ours+time_rope", "sdpa_padded(core)", "ours_fp8"}
    # No GPU: bench_graph_ms declines, so every figure is the eager one.
    assert all(r["timing"] == "eager" and r["ms"] == r["eager_ms"] == 1.0 for r in timed)
    assert all(r["vs_ours"] == 1.0 for r in timed if r["method"].startswith("sdpa"))
    checks = {r["method"]: r["rel_err"] for r in rows if r["direction"] == "check"}
    assert 0.005 < checks.pop("ours_fp8:out_vs_ours") < 0.1  # FP8's error against ours in bf16 (here fp32)
    assert checks and all(err < 1e-5 for err in checks.values())
    assert cpu_bench.exists()


def _graph_stub(ms):
    def bench_graph_ms(fn, on_error=None):
        fn()
        if ms is None and on_error is not None:
            on_error("before capture: RuntimeError: called a synchronizing CUDA operation")
        return ms

    return bench_graph_ms


def test_ratios_compare_graph_with_graph_else_eager(cpu_bench, monkeypatch):
    b = ba.make_batch("tiny", LENGTHS)
    results = ba.Results(quick=True)
    fwd = lambda: ba._op(b.q, b.k, b.v, b.offsets, ba.BLOCK_SIZE, 0, None)
    for name, eager, graph in (("ours", 2.0, 0.5), ("ours+pos_rope", 3.0, 1.0), ("sdpa_a", 4.0, 2.0), ("sdpa_b", 6.0, None)):
        monkeypatch.setattr(ba, "bench_ms", lambda fn, ms=eager: (fn(), ms)[1])
        monkeypatch.setattr(ba, "bench_graph_ms", _graph_stub(graph))
        ba._timed(results, b, name, fwd, (b.q, b.k, b.v), b.grad)
    ba._ratios(results.rows, "tiny")
    rows = {r["method"]: r for r in results.rows if r["direction"] == "fwd"}
    assert (rows["ours"]["ms"], rows["ours"]["eager_ms"], rows["ours"]["timing"]) == (0.5, 2.0, "graph")
    assert rows["ours"]["tflops"] == pytest.approx(b.flops / 0.5 / 1e9)
    assert rows["ours+pos_rope"]["rope_overhead"] == pytest.approx(1.0)  # 1.0 / 0.5 - 1 (graph / graph)
    assert rows["sdpa_a"]["vs_ours"] == pytest.approx(4.0)  # 2.0 / 0.5 (graph / graph)
    assert (rows["sdpa_b"]["timing"], rows["sdpa_b"]["ms"]) == ("eager", 6.0)
    assert rows["sdpa_b"]["graph_error"].startswith("before capture") and "graph_error" not in rows["sdpa_a"]
    assert rows["sdpa_b"]["vs_ours"] == pytest.approx(3.0)  # 6.0 / 2.0: no graph figure, so eager / eager
    assert rows["ours"]["speedup_vs_best_peer"] == pytest.approx(3.0)  # min(4.0, 3.0)


def test_flex_block_mask_tiles_and_output_match_reference(cpu_bench):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 301, (20,), generator=g)
    total, tile = int(lengths.sum()), 128
    offsets = common.offsets_of(lengths, "cpu")
    layout = ba.Layout(offsets, total, 64)
    block_mask = ba.flex_block_mask(layout, total)

    # Brute force: tile pair (i, j) is live iff some query of tile i and key of tile j share a block.
    tiles = (total + tile - 1) // tile
    query, key = torch.nonzero(layout.block_id[:, None] == layout.block_id[None, :], as_tuple=True)
    want = torch.zeros(tiles, tiles, dtype=torch.bool)
    want[query // tile, key // tile] = True

    def dense(counts, indices):  # BlockMask.to_dense assumes full-width lists; read the lists directly
        got = torch.zeros(tiles, tiles, dtype=torch.bool)
        for row in range(tiles):
            got[row, indices[0, 0, row, : counts[0, 0, row]].long()] = True
        return got

    assert torch.equal(dense(block_mask.kv_num_blocks, block_mask.kv_indices), want)
    assert torch.equal(dense(block_mask.q_num_blocks, block_mask.q_indices), want.T)  # backward's lists
    assert block_mask.shape == (1, 1, total, total)
    past = torch.tensor(total + tile - 1)  # the GPU kernel evaluates the mask on the last tile's padding
    assert not bool(block_mask.mask_mod(0, 0, torch.tensor(0), past))

    # Eager FlexAttention (its dense math path applies mask_mod; CPU has no Flex backward).
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (torch.randn(total, 2, 16, generator=g) for _ in range(3))
    as_bhtd = lambda t: t.transpose(0, 1)[None]
    out = flex_attention(as_bhtd(q), as_bhtd(k), as_bhtd(v), block_mask=block_mask)[0].transpose(0, 1)
    torch.testing.assert_close(out, reference.block_attention(q, k, v, offsets, block_size=64), rtol=1e-5, atol=1e-5)
