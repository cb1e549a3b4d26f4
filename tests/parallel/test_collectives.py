import os

import pytest

from opengem.parallel.collectives import (
    Capabilities,
    CommStats,
    _split_nccl_code,
    probe_capabilities,
    select_collectives,
    setup_environment,
)


def caps(backend="nccl", nccl=(2, 28, 3), cta_zero=True, fsdp_symm=True, symm_ag=True) -> Capabilities:
    return Capabilities(backend, nccl, cta_zero, fsdp_symm, symm_ag)


def test_default_request_uses_kernels():
    plan = select_collectives("default", caps())
    assert (plan.nccl_zero_cta, plan.fsdp_symm_mem, plan.expert_all_gather) == (False, False, "process_group")


def test_copy_engine_with_recent_nccl_uses_zero_cta_policy():
    plan = select_collectives("copy_engine", caps(nccl=(2, 29, 0)))
    assert (plan.nccl_zero_cta, plan.fsdp_symm_mem, plan.expert_all_gather) == (True, True, "process_group")
    assert "zero-CTA" in plan.reason
    without_fsdp_hook = select_collectives("copy_engine", caps(fsdp_symm=False))
    assert (without_fsdp_hook.nccl_zero_cta, without_fsdp_hook.fsdp_symm_mem) == (True, False)


@pytest.mark.parametrize("nccl, cta_zero", [((2, 27, 7), True), ((2, 28, 3), False), (None, True)])
def test_copy_engine_without_zero_cta_falls_back_to_symmetric_memory(nccl, cta_zero):
    plan = select_collectives("copy_engine", caps(nccl=nccl, cta_zero=cta_zero))
    assert (plan.nccl_zero_cta, plan.fsdp_symm_mem, plan.expert_all_gather) == (False, False, "symm_mem_copy_engine")
    nothing = select_collectives("copy_engine", caps(nccl=nccl, cta_zero=cta_zero, symm_ag=False))
    assert (nothing.nccl_zero_cta, nothing.expert_all_gather) == (False, "process_group")
    assert "no copy-engine route" in nothing.reason


def test_copy_engine_on_gloo_keeps_default_route():
    plan = select_collectives("copy_engine", caps(backend="gloo", nccl=None))
    assert (plan.nccl_zero_cta, plan.expert_all_gather) == (False, "process_group")
    assert "needs NCCL" in plan.reason


def test_unknown_request_raises():
    with pytest.raises(ValueError, match="'default' or 'copy_engine', got 'fast'"):
        select_collectives("fast", caps())


def test_nccl_version_codes():
    assert _split_nccl_code(22803) == (2, 28, 3)
    assert _split_nccl_code(2804) == (2, 8, 4)


def test_probe_on_cpu_reports_no_copy_engine():
    found = probe_capabilities("gloo")
    assert found.backend == "gloo" and found.nccl_version is None and not found.symm_mem_all_gather
    assert select_collectives("copy_engine", found).expert_all_gather == "process_group"


def test_setup_environment_turns_multicast_off_and_sets_zero_cta(monkeypatch):
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_CTA_POLICY"):
        monkeypatch.setenv(key, "")  # so that monkeypatch restores the original state afterwards
        monkeypatch.delenv(key)
    plan = setup_environment("copy_engine", caps())
    assert plan.nccl_zero_cta
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NCCL_CTA_POLICY"] == "2"
    monkeypatch.delenv("NCCL_CTA_POLICY")
    setup_environment("default", caps())
    assert "NCCL_CTA_POLICY" not in os.environ


def test_comm_stats_accumulates_and_resets():
    stats = CommStats()
    stats.record("expert", "all_gather", 100)
    stats.record("expert", "all_gather", 50)
    stats.add({("shard", "reduce_scatter"): 8})
    assert stats.bytes[("expert", "all_gather")] == 150 and stats.calls[("expert", "all_gather")] == 2
    assert stats.total() == 158
    assert stats.as_dict() == {"expert/all_gather": 150, "shard/reduce_scatter": 8}
    stats.reset()
    assert stats.total() == 0 and not stats.calls
