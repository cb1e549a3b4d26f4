"""The AdamW update on low-precision gradients that writes the weights' low-precision shadows (`opengem.ops.adamw`):
the reference and the Triton kernel (interpreter, fp16: its bf16 casts do not round to nearest even) against
``torch.optim.AdamW`` stepping the same fp32 parameters on the widened gradients."""

import os
import subprocess
import sys

import pytest
import torch

from opengem.ops.adamw import ShadowAdamWTensors, shadow_adamw_update

# (4100,): two whole blocks (BLOCK 2048) and 4 elements of a third; (2, 4098): one whole work item (4 blocks) and 4
# elements of the next
SHAPES = [(7, 5), (4100,), (3,), (2, 4098)]
HYPER = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def run_against_adamw(device: str, half: torch.dtype, backend: str, updates: int = 3, skip_at: int | None = None,
                      absent: int | None = None, misaligned: bool = False) -> None:
    """``updates`` updates of SHAPES' tensors with fresh gradients (``absent``: that tensor never gets one;
    ``skip_at``: that step is skipped on the device; ``misaligned``: the parameters are views one element into
    their storage, so the kernel takes its per-element accesses) against ``torch.optim.AdamW(fused=True)``."""
    torch.manual_seed(0)
    params = [torch.randn(shape, device=device) for shape in SHAPES]
    if misaligned:
        params = [torch.cat([p.new_zeros(1), p.flatten()])[1:].view(p.shape) for p in params]
    want = [p.clone().requires_grad_() for p in params]
    adamw = torch.optim.AdamW(want, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                              weight_decay=HYPER["weight_decay"], fused=True)
    shadows = [p.to(half) for p in params]
    steps = [torch.zeros((), device=device) for _ in params]
    tensors = ShadowAdamWTensors(params, [torch.zeros_like(p) for p in params],
                                 [torch.zeros_like(p) for p in params], shadows, steps)
    for step in range(updates):
        grads = [None if i == absent else torch.randn(shape, device=device).to(half) for i, shape in enumerate(SHAPES)]
        skip = torch.tensor(float(step == skip_at), device=device)
        for parameter, grad in zip(want, grads):
            parameter.grad = None if grad is None else grad.float()
        adamw.found_inf = skip
        adamw.step()
        shadow_adamw_update(tensors, grads, skip=skip, backend=backend, **HYPER)
    for i, (got, expected) in enumerate(zip(params, want)):
        # the same formula in fp32; the bias corrections' powers and the order of a few products differ by an ulp
        torch.testing.assert_close(got, expected.detach(), rtol=2e-6, atol=1e-7, msg=lambda m, i=i: f"tensor {i}: {m}")
        assert torch.equal(shadows[i], got.to(half)), f"shadow {i} is not its parameter rounded"
        state_step = adamw.state[expected]["step"] if i != absent else torch.zeros(())
        assert float(steps[i]) == float(state_step), f"step counter {i}"


@pytest.mark.parametrize("skip_at", [None, 1])
def test_reference_steps_as_adamw_on_the_widened_gradients(skip_at):
    for half in (torch.bfloat16, torch.float16):
        run_against_adamw("cpu", half, "reference", skip_at=skip_at)


def test_reference_leaves_a_tensor_without_gradient_alone():
    run_against_adamw("cpu", torch.bfloat16, "reference", absent=1)


def test_kernel_in_the_interpreter_steps_as_adamw():
    """In a subprocess: the interpreter is chosen when Triton is imported."""
    code = ("from tests.ops.test_adamw import run_against_adamw; import torch\n"
            "run_against_adamw('cpu', torch.float16, 'triton', skip_at=1)\n"
            "run_against_adamw('cpu', torch.float16, 'triton', absent=2)\n"
            "run_against_adamw('cpu', torch.float16, 'triton', misaligned=True)\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_address_table_says_whether_every_tensor_is_16_byte_aligned():
    from opengem.ops.triton.adamw import address_table

    buffer = torch.zeros(64)
    table, aligned = address_table([buffer[:8], buffer[4:12]], torch.device("cpu"))
    assert aligned and table.tolist() == [buffer.data_ptr(), buffer.data_ptr() + 16]
    assert not address_table([buffer[:8], buffer[1:9]], torch.device("cpu"))[1]  # 4 bytes in


def _tensors(n: int = 2) -> ShadowAdamWTensors:
    params = [torch.zeros(4, 3) for _ in range(n)]
    return ShadowAdamWTensors(params, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params],
                              [p.bfloat16() for p in params], [torch.zeros(()) for _ in params])


def test_bad_tensors_are_refused_by_name():
    p = torch.zeros(4, 3)
    ok = {"params": [p], "exp_avgs": [torch.zeros_like(p)], "exp_avg_sqs": [torch.zeros_like(p)],
          "shadows": [p.bfloat16()], "steps": [torch.zeros(())]}
    cases = [
        ({"exp_avgs": []}, "one of each a parameter"),
        ({"exp_avg_sqs": [torch.zeros(3, 4)]}, r"exp_avg_sqs\[0\] must be a contiguous torch.float32 tensor"),
        ({"exp_avgs": [torch.zeros(3, 4).t()]}, r"exp_avgs\[0\].*not contiguous"),
        ({"params": [p.double()]}, r"params\[0\] must be a contiguous torch.float32"),
        ({"shadows": [p.float()]}, "shadows must all be bf16 or all fp16"),
        ({"steps": [torch.zeros(1)]}, r"steps\[0\] must be a 0-d fp32 tensor"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            ShadowAdamWTensors(**{**ok, **change})


def test_bad_gradients_and_settings_are_refused_by_name():
    tensors = _tensors()
    grad = torch.zeros(4, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one gradient .or None. a parameter: got 1 for 2"):
        shadow_adamw_update(tensors, [grad], **HYPER)
    with pytest.raises(ValueError, match=r"grads\[1\] must be the gradient of shadows\[1\]"):
        shadow_adamw_update(tensors, [grad, grad.float()], **HYPER)
    with pytest.raises(ValueError, match=r"grads\[0\] must be the gradient of shadows\[0\]"):
        shadow_adamw_update(tensors, [torch.zeros(3, 4, dtype=torch.bfloat16), None], **HYPER)
    for name, value in (("lr", -1.0), ("eps", float("nan")), ("weight_decay", -0.1)):
        with pytest.raises(ValueError, match=f"{name} must be finite and >= 0"):
            shadow_adamw_update(tensors, [grad, grad], **{**HYPER, name: value})
    with pytest.raises(ValueError, match=r"betas\[1\] must be finite and >= 0 and < 1"):
        shadow_adamw_update(tensors, [grad, grad], **{**HYPER, "betas": (0.9, 1.0)})
    with pytest.raises(ValueError, match="skip must be one element"):
        shadow_adamw_update(tensors, [grad, grad], skip=torch.zeros(2), **HYPER)
    with pytest.raises(ValueError, match="backend must be"):
        shadow_adamw_update(tensors, [grad, grad], backend="cuda", **HYPER)
    assert all(float(s) == 0 for s in tensors.steps)  # nothing refused moved a counter


def test_benchmark_takes_every_linear_parameter_and_checks_one_update():
    from benchmarks.optimizer import check_one_update, linear_shapes

    shapes = linear_shapes("gem-large")
    assert sum(s.numel() for s in shapes) == 1_112_740_296  # 99.8% of gem-large's 1.1146B dense parameters
    check = check_one_update(linear_shapes("gem-tiny"), "cpu")
    assert check["shadows_rounded"] and check["max_param_rel_error"] < 1e-6, check
    assert check["bf16_moments_max_param_rel_error"] < 1e-3, check  # within the moments' rounding


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from opengem.ops.triton import adamw as a

constexpr_names = ("HAS_SKIP", "HALF_IS_BF16", "MOMENTS_BF16", "ALIGNED", "BLOCK", "BLOCKS_PER_ITEM")
names = [n for n in a._shadow_adamw_kernel.arg_names if n not in constexpr_names]
types = {"item_tensor": "*i32", "item_block": "*i32", "numels": "*i64", "skip": "*fp32", "log2_betas": "*fp64",
         "hyper": "*fp32", "rounding_seed": "i64"}
signature = {n: types.get(n, "*i64" if n.endswith("_table") else "fp32") for n in names}
for half_is_bf16, moments_bf16, aligned in ((True, False, True), (False, False, True), (True, True, True),
                                            (False, True, True), (True, False, False), (True, True, False)):
    constexprs = dict(HAS_SKIP=True, HALF_IS_BF16=half_is_bf16, MOMENTS_BF16=moments_bf16, ALIGNED=aligned,
                      BLOCK=a.BLOCK, BLOCKS_PER_ITEM=a.BLOCKS_PER_ITEM)
    ptx = triton.compile(ASTSource(a._shadow_adamw_kernel, {**signature, **{k: "constexpr" for k in constexprs}},
                                   constexprs), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=a.NUM_WARPS)).asm["ptx"]
    assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx  # IEEE, not the approximate forms
    assert "ex2.approx" not in ptx  # the bias corrections' powers in fp64 (libdevice), not the fp32 approximation
    rounds_to_bf16 = "cvt.rn.bf16.f32" in ptx or "cvt.rn.bf16x2.f32" in ptx
    # shadows rounded to nearest; the stochastically rounded moments' casts are exact (their low half cleared)
    assert rounds_to_bf16 == (half_is_bf16 or moments_bf16)
    assert ("mul.lo" in ptx) == moments_bf16  # the rounding bits' hash: 32-bit products that wrap
    # 16-byte loads and stores where every address is aligned (session 62: one access an element before)
    assert ("ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx) == aligned
print("compiled")
"""


def test_kernel_compiles_for_sm90_with_exact_arithmetic():
    from tests.ops.aot import run_compiled

    result = run_compiled(_COMPILE_SCRIPT)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]


def test_settings_of_the_wrong_kind_are_refused_by_name():
    """Session 70's audit: True had run as lr 1, a third beta was dropped, 1.5 and True taken as seeds, and a bool
    skip flag failed inside torch."""
    tensors = _tensors()
    grads = [torch.zeros(4, 3, dtype=torch.bfloat16)] * 2
    with pytest.raises(ValueError, match=r"lr must be finite and >= 0 \(a number\), got True"):
        shadow_adamw_update(tensors, grads, **{**HYPER, "lr": True})
    with pytest.raises(ValueError, match=r"betas must be a pair \(beta1, beta2\), got \(0.9, 0.99, 0.5\)"):
        shadow_adamw_update(tensors, grads, **{**HYPER, "betas": (0.9, 0.99, 0.5)})
    for seed in (1.5, True):
        with pytest.raises(ValueError, match=r"rounding_seed must be in \[0, 2 \*\* 32\) \(an int\)"):
            shadow_adamw_update(tensors, grads, **HYPER, rounding_seed=seed)
    with pytest.raises(ValueError, match=r"skip must be one element on cpu \(not bool\), got torch.bool"):
        shadow_adamw_update(tensors, grads, skip=torch.tensor([True]), **HYPER)
