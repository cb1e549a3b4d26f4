"""benchmarks.diag.gluon_common on the CPU: the tile schedule, the (sample, tile) items the Gluon diags' kernels launch
over (the kernels themselves need triton 3.6 and a Hopper GPU), and the diags' ``--variants`` choice."""

from collections import namedtuple

import pytest
import torch

from benchmarks.diag.gluon_common import chosen_variants, tile_schedule
from opengem.ops.gluon.hopper import launch_registers


def test_every_row_is_in_exactly_one_tile_longest_samples_first():
    lengths = torch.tensor([3, 130, 128, 1, 300])
    start, length, m_start = tile_schedule(lengths, 128, "cpu")
    assert start.dtype == length.dtype == m_start.dtype == torch.int32
    # sample 4 (300 rows: three tiles) first, then 130 (two), 128, 3, 1
    assert length.tolist() == [300, 300, 300, 130, 130, 128, 3, 1]
    assert start.tolist() == [262, 262, 262, 3, 3, 133, 0, 261]
    assert m_start.tolist() == [0, 128, 256, 0, 128, 0, 0, 0]
    covered = torch.zeros(int(lengths.sum()), dtype=torch.int64)
    for s, n, m in zip(start.tolist(), length.tolist(), m_start.tolist()):
        covered[s + m: s + min(m + 128, n)] += 1
    assert torch.equal(covered, torch.ones_like(covered))


def test_variants_are_chosen_by_name_in_the_order_given_and_unknown_names_are_refused():
    Named = namedtuple("Named", "name")
    variants = (Named("gluon_a"), Named("gluon_b"), Named("gluon_c"))
    assert chosen_variants(variants, None) == list(variants)
    assert chosen_variants(variants, ["gluon_c", "gluon_a"]) == [variants[2], variants[0]]
    with pytest.raises(SystemExit, match=r"unknown \['gluon_x'\]; known: \['gluon_a', 'gluon_b', 'gluon_c'\]"):
        chosen_variants(variants, ["gluon_a", "gluon_x"])


def test_launch_registers_share_out_the_64k_register_file_in_multiples_of_8():
    # 12 warps (two consumer warpgroups and the loader's): 170 a thread rounds down to 168; 16 warps: exactly 128
    assert launch_registers(12) == 168
    assert launch_registers(16) == 128
    for warps in range(4, 33, 4):
        registers = launch_registers(warps)
        assert registers % 8 == 0 and registers * 32 * warps <= 65536 < (registers + 8) * 32 * warps


def test_dkdv_variants_have_unique_names_pass_their_checks_and_fit_the_register_file():
    """Each listed dK/dV variant builds as named (a shared name would make ``--variants`` ambiguous), and its launch
    registers times the threads of every program an SM holds fit the 64K register file (one 64-key program's
    8 warps: 4 MMA, the loader's padded warpgroup; two of them an SM)."""
    from benchmarks.diag.gluon_gdpa_dkdv_kernels import VARIANTS, Variant

    names = [v.name for v in VARIANTS]
    assert len(set(names)) == len(names)
    for variant in VARIANTS:
        variant.check()
        mma_warps = variant.block_n // 16
        warps = mma_warps + 4 + (4 if variant.dq == "writer" else 0)
        assert variant.maxnreg * 32 * warps * variant.programs_per_sm <= 65536, variant.name
    n64 = Variant(32, 3, block_n=64)
    assert (n64.name, n64.num_warps, n64.programs_per_sm, n64.maxnreg) == ("gluon_m32_s3_n64", 4, 2, 128)
    for bad in (Variant(32, 3, "red4", block_n=64), Variant(32, 3, halves=True, block_n=64),
                Variant(32, 3, "red4", halves=True), Variant(32, 3, "writer", pipelined=True),
                Variant(64, 2, "red4", dq_slots=1), Variant(64, 2, "tma", dq_slots=3)):
        with pytest.raises(ValueError):
            bad.check()


def test_forward_variants_have_unique_names_pass_their_checks_and_fit_the_register_file():
    """As for dK/dV: a 64-row program is one 4-warp consumer and the loader's padded warpgroup, two an SM."""
    from benchmarks.diag.gluon_gdpa_forward_kernels import VARIANTS, Variant
    from opengem.ops.gluon import gdpa_forward as op_kernel

    names = [v.name for v in VARIANTS]
    assert len(set(names)) == len(names)
    for variant in VARIANTS:
        variant.check()
        assert variant.maxnreg * 32 * (variant.block_m // 16 + 4) * variant.programs_per_sm <= 65536, variant.name
    assert sorted({v.block_m for v in VARIANTS}) == [64, 128]
    persistent = [v for v in VARIANTS if v.persistent]  # the op's kernel, at two key tiles
    assert {v.maxnreg for v in persistent} == {op_kernel.LAUNCH_REGISTERS}
    assert (op_kernel.BLOCK_N, op_kernel.STAGES) in {(v.block_n, v.stages) for v in persistent}
    m64 = Variant(32, 3, 1, block_m=64)
    assert (m64.name, m64.num_warps, m64.maxnreg) == ("gluon_m64_n32_s3_overlap_x2", 4, 128)
    assert (VARIANTS[0].name, VARIANTS[0].num_warps, VARIANTS[0].maxnreg) == ("gluon_n64_s3_overlap", 8, 168)
    for bad in (Variant(32, 3, 2, block_m=64), Variant(32, 3, 1, persistent=True, block_m=64)):
        with pytest.raises(ValueError):
            bad.check()
