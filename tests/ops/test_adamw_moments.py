"""The shadow AdamW with bf16 moments (`opengem.ops.adamw`): stochastic rounding in the reference (unbiased, keyed
for exact resumes), the Triton kernel (interpreter) against it with the same rounding bits, and AdamW's trajectory
kept."""

import os
import subprocess
import sys

import pytest
import torch

from opengem.ops.adamw import ShadowAdamWTensors, shadow_adamw_update
from opengem.ops.reference.rounding import rounding_bits, rounding_key, stochastic_round_bf16
from tests.ops.test_adamw import HYPER, SHAPES


def _tensors(moments: torch.dtype, half: torch.dtype = torch.bfloat16, device: str = "cpu") -> ShadowAdamWTensors:
    torch.manual_seed(0)
    params = [torch.randn(shape, device=device) for shape in SHAPES]
    return ShadowAdamWTensors(params, [torch.zeros(s, dtype=moments, device=device) for s in SHAPES],
                              [torch.zeros(s, dtype=moments, device=device) for s in SHAPES],
                              [p.to(half) for p in params], [torch.zeros((), device=device) for _ in SHAPES])


def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased():
    x = torch.randn(1 << 16) * 3
    bits = rounding_bits(x.numel(), rounding_key(5, 1, 0), 0)
    got = stochastic_round_bf16(x, bits).float().view(torch.int32)
    pattern = x.view(torch.int32)
    toward_zero = pattern & ~0xFFFF  # the neighbour nearer zero; the other is one bf16 ulp (0x10000) further
    away = (pattern & 0xFFFF) + bits >= 1 << 16  # rounded away exactly where the discarded half carries over
    assert torch.equal(got, torch.where(away, toward_zero + (1 << 16), toward_zero))
    # one value many times: the mean is the value (to nearest, every draw would be 1.0)
    value = torch.full((1 << 16,), 1 + 2**-10)
    draws = stochastic_round_bf16(value, rounding_bits(value.numel(), rounding_key(5, 1, 0), 1)).float()
    assert set(draws.unique().tolist()) == {1.0, 1 + 2**-7}
    # rounded up with probability 1/8: the mean of 2 ** 16 draws has a standard deviation of 1.0e-5 (5 of them here;
    # rounded to nearest it would sit 9.8e-4 below)
    assert draws.double().mean().item() == pytest.approx(1 + 2**-10, abs=5e-5)
    signs = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
    assert torch.equal(stochastic_round_bf16(signs, torch.full((4,), 0xFFFF)).float(), signs)


def test_the_second_moment_decays_where_round_to_nearest_would_stall():
    """beta2 * v moves v by 1e-3 relative, under half a bf16 ulp: rounded to nearest it never decays."""
    rounded, stochastic = torch.ones(8192, dtype=torch.bfloat16), torch.ones(8192, dtype=torch.bfloat16)
    for step in range(1, 201):
        rounded = (rounded.float() * 0.999).bfloat16()
        bits = rounding_bits(stochastic.numel(), rounding_key(0, step, 0), 1)
        stochastic = stochastic_round_bf16(stochastic.float() * 0.999, bits)
    assert torch.all(rounded == 1)
    assert stochastic.float().mean().item() == pytest.approx(0.999**200, rel=2e-3)


def test_rounding_bits_depend_on_seed_step_tensor_and_stream():
    keys = {rounding_key(seed, step, tensor) for seed in (0, 1) for step in (1, 2) for tensor in (0, 1)}
    assert len(keys) == 8
    key = rounding_key(0, 1, 0)
    first, second = rounding_bits(4096, key, 0), rounding_bits(4096, key, 1)
    assert not torch.equal(first, second) and torch.equal(first, rounding_bits(4096, key, 0))
    assert int(first.min()) >= 0 and int(first.max()) < 1 << 16
    assert abs(first.double().mean().item() / 65535 - 0.5) < 0.02


def test_bf16_moments_follow_fp32_adamw_closely():
    """50 steps on the same gradients: the weights stay within 1% of how far fp32-moment AdamW moved them."""
    fp32, bf16 = _tensors(torch.float32), _tensors(torch.bfloat16)
    start = [p.clone() for p in fp32.params]
    for step in range(50):
        torch.manual_seed(100 + step)
        grads = [torch.randn(shape).bfloat16() for shape in SHAPES]
        shadow_adamw_update(fp32, grads, backend="reference", **HYPER)
        shadow_adamw_update(bf16, grads, backend="reference", rounding_seed=3, **HYPER)
    for i, (want, got, first) in enumerate(zip(fp32.params, bf16.params, start)):
        moved = (want - first).abs().mean()
        assert (got - want).abs().mean() < 0.01 * moved, i
        assert torch.equal(bf16.shadows[i], got.bfloat16())
        assert bf16.exp_avgs[i].dtype == torch.bfloat16 and float(bf16.steps[i]) == 50


def test_same_seed_same_rounding_other_seed_other_rounding():
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        tensors = _tensors(torch.bfloat16)
        torch.manual_seed(1)
        shadow_adamw_update(tensors, [torch.randn(s).bfloat16() for s in SHAPES], backend="reference",
                            rounding_seed=seed, **HYPER)  # fmt: skip
        runs[name] = torch.cat([m.float().flatten() for m in tensors.exp_avg_sqs])
    assert torch.equal(runs["a"], runs["b"]) and not torch.equal(runs["a"], runs["c"])


def compare_kernel_with_reference(half: torch.dtype, device: str = "cpu") -> None:
    """Three updates (a skipped one and a tensor without gradient among them): the kernel's bf16 moments are the
    reference's (the same rounding bits), but where the fp32 moment before rounding differs by an ulp of its terms
    (a fused multiply-add, another order of the two products) and that carries into the kept half: one bf16 ulp
    apart, or further for a moment that cancels to near zero (within an fp32 ulp of the tensor's largest); in about 1
    of 2,000 elements. The weights within fp32 ulps."""
    want, got = _tensors(torch.bfloat16, half, device), _tensors(torch.bfloat16, half, device)
    for step in range(3):
        torch.manual_seed(10 + step)
        grads = [None if i == 2 else torch.randn(s, device=device).to(half) for i, s in enumerate(SHAPES)]
        skip = torch.tensor(float(step == 1), device=device)
        shadow_adamw_update(want, grads, backend="reference", skip=skip, rounding_seed=11, **HYPER)
        shadow_adamw_update(got, grads, backend="triton", skip=skip, rounding_seed=11, **HYPER)
    for i in range(len(SHAPES)):
        for moment, expected in ((got.exp_avgs[i], want.exp_avgs[i]), (got.exp_avg_sqs[i], want.exp_avg_sqs[i])):
            ulps = (moment.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
            cancelled = (moment.float() - expected.float()).abs() <= 2**-23 * expected.float().abs().max()
            assert bool(torch.all((ulps <= 1) | cancelled)), i
            assert int((ulps > 0).sum()) <= max(1, moment.numel() // 1000), (i, int((ulps > 0).sum()))
        torch.testing.assert_close(got.params[i], want.params[i], rtol=2e-6, atol=1e-7)
        assert float(got.steps[i]) == float(want.steps[i]) == (0 if i == 2 else 2)
    assert torch.equal(got.exp_avgs[2], torch.zeros_like(got.exp_avgs[2]))


def test_kernel_in_the_interpreter_rounds_the_moments_as_the_reference():
    """In a subprocess: the interpreter is chosen when Triton is imported. fp16 shadows: the interpreter's bf16
    casts do not round to nearest even (the moments' casts are exact, their low half cleared first)."""
    code = ("from tests.ops.test_adamw_moments import compare_kernel_with_reference; import torch\n"
            "compare_kernel_with_reference(torch.float16)\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_mixed_moments_and_bad_seeds_are_refused_by_name():
    p = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="the moments must all be fp32 or all bf16"):
        ShadowAdamWTensors([p], [torch.zeros_like(p)], [p.bfloat16()], [p.bfloat16()], [torch.zeros(())])
    with pytest.raises(ValueError, match="the moments must all be fp32 or all bf16"):
        ShadowAdamWTensors([p], [p.half()], [p.half()], [p.bfloat16()], [torch.zeros(())])
    tensors = _tensors(torch.bfloat16)
    grads = [torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES]
    for seed in (-1, 2**32):
        with pytest.raises(ValueError, match=r"rounding_seed must be in \[0, 2 \*\* 32\)"):
            shadow_adamw_update(tensors, grads, rounding_seed=seed, **HYPER)
    assert all(float(s) == 0 for s in tensors.steps)
