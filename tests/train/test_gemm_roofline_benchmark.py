"""benchmarks.diag.gemm_roofline: the floor of each GEMM (FLOPs at the matmul ceiling, or bytes at HBM bandwidth),
and the step's GEMMs recorded from gem-tiny's compiled step on the CPU and projected to a larger batch."""

import pytest
import sympy

from benchmarks.diag.gemm_roofline import Projection, gemm_cost, record_step, roofline, totals


def test_gemm_cost_counts_flops_and_each_operand_once():
    mm_bytes = 2 * (1000 * 256 + 256 * 512 + 1000 * 512)
    assert gemm_cost("mm", (1000, 256), (256, 512), 2) == (2 * 1000 * 256 * 512, mm_bytes)
    bmm_flops = 2 * 4 * 8 * 16 * 32
    assert gemm_cost("bmm", (4, 8, 16), (4, 16, 32), 4) == (bmm_flops, 4 * 4 * (8 * 16 + 16 * 32 + 8 * 32))
    # Wukong's token mixings: the left operand broadcast over the batch (stride 0) is read once
    shared_left = gemm_cost("bmm", (4, 8, 16), (4, 16, 32), 4, (True, False))
    assert shared_left == (bmm_flops, 4 * (8 * 16 + 4 * (16 * 32 + 8 * 32)))
    with pytest.raises(ValueError, match=r"mm operands must be \[m, k\] and \[k, n\], got \(8, 16\) and \(8, 4\)"):
        gemm_cost("mm", (8, 16), (8, 4), 2)
    with pytest.raises(ValueError, match="bmm operands"):
        gemm_cost("bmm", (2, 8, 16), (16, 4), 2)
    with pytest.raises(ValueError, match=r"got \(2, 8, 16\) and \(3, 16, 4\)"):  # batch sizes differ
        gemm_cost("bmm", (2, 8, 16), (3, 16, 4), 2)


def test_a_narrow_gemm_is_memory_bound_and_a_wide_one_compute_bound():
    # [T, 256] x [256, 256]: 128 FLOPs a byte, under an H100's ~295
    narrow = roofline("mm", "forward", ((1 << 20, 256), (256, 256)), 3, 2, 989.0, 3.35)
    _, nbytes = gemm_cost("mm", (1 << 20, 256), (256, 256), 2)
    assert narrow.bound == "memory"
    assert narrow.floor_ms == pytest.approx(3 * nbytes / 3.35e12 * 1e3)
    wide = roofline("mm", "backward", ((8192, 8192), (8192, 8192)), 1, 2, 989.0, 3.35)
    assert wide.bound == "compute"
    assert wide.floor_ms == pytest.approx(2 * 8192**3 / 989e12 * 1e3)
    total = totals([narrow, wide], 989.0)
    assert total["floor_ms"] == pytest.approx(narrow.floor_ms + wide.floor_ms)
    assert 0 < total["memory_bound_share"] < 1


def test_projected_sizes_scale_the_batch_and_the_tokens_apart():
    b, t, other = sympy.symbols("b t other")
    got = Projection(batch=4, tokens=90, target_batch=16, target_tokens=900.0).sizes({b: 4, t: 90, other: 30})
    assert got == {b: 16, t: 900, other: 300}


def test_gem_tiny_step_projected_to_twice_the_batch_and_tokens_doubles_every_gemm():
    shapes, batch, tokens = record_step("gem-tiny", 4, "cpu", [])
    assert batch == 4 and tokens > 0
    same = shapes.rooflines(Projection(batch, tokens, batch, tokens), 989.0, 3.35)
    double = shapes.rooflines(Projection(batch, tokens, 2 * batch, 2 * tokens), 989.0, 3.35)
    kinds = {r.kind for r in same}
    assert kinds == {"forward", "backward"}
    # dX and dW for each forward GEMM (the dense features take no input gradient)
    assert sum(r.calls for r in same if r.kind == "backward") > sum(r.calls for r in same if r.kind == "forward")
    assert sum(r.calls for r in double) == sum(r.calls for r in same)
    # every GEMM of the step has a row count (or a reduction) over samples or tokens: FLOPs double, up to rounding
    assert totals(double, 989.0)["tflop"] == pytest.approx(2 * totals(same, 989.0)["tflop"], rel=0.02)
    assert all(r.floor_ms > 0 for r in same)
