"""Triton kernel of the AdamW update on low-precision gradients that writes low-precision weight copies.

Formula and order: `opengem.ops.reference.adamw`. One launch updates every tensor of a list: the tensors' addresses
sit in int64 tables on the device (the moments', weights', copies' and step counters' once, the gradients' each
call, since autograd makes new ones every step), and each program takes BLOCKS_PER_ITEM x BLOCK elements of one
tensor, named by a precomputed (tensor, first block) work list. Each element is read and written once: 4 B of
weight, 2 of gradient and 8 of moments read; 4 + 8 B and 2 B of copy written (28 B; PyTorch's fused AdamW on fp32
gradients also moves 28 B, but the gradients' and the copies' casts add 6 B each around it). With bf16 moments
(``MOMENTS_BF16``) the moments move 4 B each instead of 8: 20 B; they are stored rounded stochastically with the
reference's random bits (`opengem.ops.reference.rounding.paired_rounding_bits`: one counter hash an element, bit
for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opengem.jagged.host import to_device
from opengem.ops.triton.rounding import mix32, rounding_key, store_bf16_rounded_by

# The launch shape measured fastest on an H100 (session 63, `benchmarks/diag/adamw_launch_configs.py`, 27 shapes a
# moment dtype): 4 elements a thread, 54 registers under Triton 3.6 (32 warps an SM) where 4096 x 8 warps held 255
# (8 warps an SM). gem-large's update: bf16 moments 7.49 ms (98% of a copy) against 9.30, fp32 10.46 against 11.11.
BLOCK = 2048  # elements a loop iteration: one 16-byte fp32 access a thread and tensor where aligned
BLOCKS_PER_ITEM = 4  # a program's share: its table reads and bias corrections paid once per 8192 elements
NUM_WARPS = 16
ALIGNMENT = 16  # bytes: the kernel's vector accesses where every tensor starts on such an address


@triton.jit
def _tensor_pointer(table, t, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """Tensor ``t``'s address from ``table`` as a pointer to ``dtype``; with ``ALIGNED`` (every address ALIGNMENT,
    16, bytes aligned, checked on the host) hinted so, for 16-byte accesses instead of one an element (Triton cannot
    see the alignment of an address read from memory)."""
    pointer = tl.load(table + t).to(tl.pointer_type(dtype))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _update_block(offsets, mask, pointers, scalars, MOMENTS_BF16: tl.constexpr):
    """One block of elements (``mask`` None for a full block: unmasked accesses vectorize). ``pointers`` and
    ``scalars``: the kernel's tuples of the tensor's typed addresses and of its step's hyperparameters."""
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, shadow_ptr = pointers
    lr_weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt, key = \
        scalars
    param = tl.load(param_ptr + offsets, mask=mask)
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
    param = param - lr_weight_decay * param
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    # IEEE square root and quotients (tl.sqrt and / are approximate): the kernel is memory-bound either way
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param = param - tl.div_rn(step_size * exp_avg, denom)
    tl.store(param_ptr + offsets, param, mask=mask)
    if MOMENTS_BF16:  # one hash an element, its halves the reference's two streams
        hashed = mix32(offsets.to(tl.uint32) ^ key)
        store_bf16_rounded_by(exp_avg_ptr + offsets, exp_avg, hashed & 0xFFFF, mask)
        store_bf16_rounded_by(exp_avg_sq_ptr + offsets, exp_avg_sq, hashed >> 16, mask)
    else:
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    tl.store(shadow_ptr + offsets, param.to(shadow_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit(do_not_specialize=["rounding_seed"])
def _shadow_adamw_kernel(
    item_tensor, item_block, numels, param_table, grad_table, exp_avg_table, exp_avg_sq_table, shadow_table,
    step_table, skip, log2_betas, hyper, rounding_seed,
    HAS_SKIP: tl.constexpr, HALF_IS_BF16: tl.constexpr, MOMENTS_BF16: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr, BLOCKS_PER_ITEM: tl.constexpr,
):
    item = tl.program_id(0)
    t = tl.load(item_tensor + item)
    first = tl.load(item_block + item).to(tl.int64) * BLOCK
    numel = tl.load(numels + t)
    if HAS_SKIP:  # a skipped step writes nothing
        numel = tl.where(tl.load(skip) == 0, numel, 0)
    half: tl.constexpr = tl.bfloat16 if HALF_IS_BF16 else tl.float16
    moment: tl.constexpr = tl.bfloat16 if MOMENTS_BF16 else tl.float32
    pointers = (_tensor_pointer(param_table, t, tl.float32, ALIGNED), _tensor_pointer(grad_table, t, half, ALIGNED),
                _tensor_pointer(exp_avg_table, t, moment, ALIGNED),
                _tensor_pointer(exp_avg_sq_table, t, moment, ALIGNED), _tensor_pointer(shadow_table, t, half, ALIGNED))
    # bias corrections in fp64 from the betas' fp64 logarithms, as PyTorch's fused AdamW computes them in double
    # (fp32's approximate exp2 moved 1 - beta2 ** step by ~1e-4 relative at step 1)
    lr, beta1, one_minus_beta1 = tl.load(hyper), tl.load(hyper + 1), tl.load(hyper + 2)
    beta2, one_minus_beta2 = tl.load(hyper + 3), tl.load(hyper + 4)
    eps, lr_weight_decay = tl.load(hyper + 5), tl.load(hyper + 6)
    step = tl.load(tl.load(step_table + t).to(tl.pointer_type(tl.float32))).to(tl.float64)
    step_size = (lr / (1 - tl.exp2(step * tl.load(log2_betas)))).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(1 - tl.exp2(step * tl.load(log2_betas + 1))).to(tl.float32)
    key = 0
    if MOMENTS_BF16:  # the reference's key: the seed, the step and the tensor's place
        key = rounding_key(rounding_seed, step, t)
    scalars = (lr_weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size,
               bias_correction2_sqrt, key)
    for i in range(BLOCKS_PER_ITEM):
        start = first + i * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        if start + BLOCK <= numel:  # a full block: no mask, so an aligned tensor's accesses vectorize
            _update_block(offsets, None, pointers, scalars, MOMENTS_BF16)
        else:  # the tensor's last, partial block (or past its end: all masked)
            _update_block(offsets, offsets < numel, pointers, scalars, MOMENTS_BF16)


def work_items(numels: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tensor index, first block)`` of every program's BLOCKS_PER_ITEM x BLOCK elements, two int32 device tensors."""
    blocks = torch.tensor([triton.cdiv(n, BLOCK * BLOCKS_PER_ITEM) for n in numels], dtype=torch.int64)
    tensors = torch.repeat_interleave(torch.arange(len(numels)), blocks)
    starts = torch.cumsum(blocks, 0) - blocks
    within = (torch.arange(tensors.numel()) - starts[tensors]) * BLOCKS_PER_ITEM
    return tensors.to(device, torch.int32), within.to(device, torch.int32)


def address_table(tensors: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, bool]:
    """The tensors' addresses as an int64 device tensor, and whether every one is 16-byte aligned (the kernel's
    vector accesses; PyTorch's allocations are, a view at an odd offset may not be)."""
    addresses = [t.data_ptr() for t in tensors]
    return (to_device(torch.tensor(addresses, dtype=torch.int64), device),
            all(address % ALIGNMENT == 0 for address in addresses))


def hyperparameters(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                    device: torch.device) -> torch.Tensor:
    """The kernel's fp32 ``hyper`` tensor: ``lr, beta1, 1 - beta1, beta2, 1 - beta2, eps, lr * weight_decay``, the
    differences and product taken in double first, as PyTorch's fused AdamW takes them (``1 - 0.999`` in fp32
    arithmetic is off by 1.3e-5 relative: 0.999 rounds to 0.99900001; the H100's test caught it, session 59). A
    tensor, not scalar arguments, so the interpreter reads the same fp32 values as the GPU (it kept scalar
    arguments in double)."""
    values = [lr, beta1, 1 - beta1, beta2, 1 - beta2, eps, lr * weight_decay]
    return to_device(torch.tensor(values, dtype=torch.float32), device)


def shadow_adamw_launch(
    items: tuple[torch.Tensor, torch.Tensor], numels: torch.Tensor, tables: dict[str, torch.Tensor],
    grad_table: torch.Tensor, skip: torch.Tensor | None, log2_betas: torch.Tensor, hyper: torch.Tensor,
    half_is_bf16: bool, moments_bf16: bool = False, rounding_seed: int = 0, aligned: bool = False,
) -> None:
    """``log2_betas``: fp64 ``[log2(beta1), log2(beta2)]`` on the device; ``hyper``: :func:`hyperparameters`;
    ``rounding_seed`` (uint32) keys the bf16 moments' rounding; ``aligned``: every address of the tables is
    ``ALIGNMENT``-byte aligned (:func:`address_table` says)."""
    item_tensor, item_block = items
    if item_tensor.numel() == 0:
        return
    _shadow_adamw_kernel[(item_tensor.numel(),)](
        item_tensor, item_block, numels, tables["param"], grad_table, tables["exp_avg"], tables["exp_avg_sq"],
        tables["shadow"], tables["step"], skip if skip is not None else numels, log2_betas, hyper, rounding_seed,
        HAS_SKIP=skip is not None, HALF_IS_BF16=half_is_bf16, MOMENTS_BF16=moments_bf16, ALIGNED=aligned,
        BLOCK=BLOCK, BLOCKS_PER_ITEM=BLOCKS_PER_ITEM,
        num_warps=NUM_WARPS,
    )
