"""The persistent Gluon GDPA forward (``opengem.ops.gluon.gdpa_forward``) inside the op, on an sm_90 GPU with triton
3.6, against the fp32 reference; ``OPENGEM_GDPA_GLUON=only`` makes it the forward wherever it applies, and a spy
proves it ran (skipped without CUDA)."""

import math

import pytest
import torch

from opengem.ops import gluon
from opengem.ops.activations import ACTIVATIONS
from opengem.ops.gluon import gdpa_forward as gluon_gdpa
from opengem.ops.triton import gdpa as triton_gdpa
from opengem.ops.triton.gdpa import GdpaArgs, gdpa_forward
from tests.gpu.test_gdpa_gpu import DEVICE, _check, _offsets

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# self-attention lengths: one and several 128-row query tiles, partial tiles, a single token, an empty sample
LENGTHS = [300, 1, 0, 129, 64, 700]


@pytest.fixture
def gluon_calls(monkeypatch) -> list:
    """``OPENGEM_GDPA_GLUON=only``, and the Gluon launches the op makes."""
    assert gluon.available(torch.device(DEVICE)), "the GPU image is an H100 / H200 with triton 3.6"
    monkeypatch.setenv("OPENGEM_GDPA_GLUON", "only")
    calls = []
    launch = gluon_gdpa.gdpa_forward

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return launch(*args, **kwargs)

    monkeypatch.setattr(gluon_gdpa, "gdpa_forward", spy)
    return calls


@pytest.mark.parametrize("activation", [a for a in ACTIVATIONS])
def test_every_activation_self_attention(gluon_calls, activation):
    _check(LENGTHS, LENGTHS, activation=activation, pre_scale=0.05)
    assert gluon_calls, "the Gluon forward did not run"


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa_and_cross_attention(gluon_calls, kv_heads):
    _check([300, 50, 700, 0], [128, 256, 1, 0], heads=4, kv_heads=kv_heads)  # short K/V, one key, no queries
    assert gluon_calls
    gluon_calls.clear()
    _check(LENGTHS, LENGTHS, heads=4, kv_heads=kv_heads, pre_scale=0.02)
    assert gluon_calls


def test_packed_qkv_views_and_poisoned_output(gluon_calls):
    """q, k, v as views of one ``[T, 3, H, D]`` projection (row stride 3 H D) into a NaN-filled ``out``: every row
    written, equal to the Triton forward's."""
    lengths = [257, 3, 128]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    qkv = torch.randn(sum(lengths), 3, 4, 128, generator=gen, device=DEVICE).bfloat16()
    q, k, v = qkv.unbind(1)
    offsets = _offsets(lengths)
    args = GdpaArgs((ACTIVATIONS.index("silu"),) * 4, 0.08, 1 / 257, False, 0, None, False, 257, 257)
    out = torch.full_like(q, math.nan)
    gdpa_forward(q, k, v, offsets, offsets, None, args, out=out)
    assert gluon_calls
    triton_out = torch.full_like(q, math.nan)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPENGEM_GDPA_GLUON", "off")
        gdpa_forward(q, k, v, offsets, offsets, None, args, out=triton_out)
    assert torch.isfinite(out).all()
    assert float((out.double() - triton_out.double()).norm() / triton_out.double().norm()) < 1e-2


def test_what_it_cannot_take_goes_to_the_triton_kernel(gluon_calls):
    """A sample with queries and no keys (its output is zeros), a mask, per-head activations: the Triton forward."""
    _check([300, 40], [200, 0], heads=2, kv_heads=2)
    _check(LENGTHS, LENGTHS, mask={"causal": True})
    _check(LENGTHS, LENGTHS, heads=2, kv_heads=2, head_activations=["silu", "relu"])
    assert not gluon_calls


def test_the_tuner_times_it_beside_the_triton_candidates(monkeypatch):
    monkeypatch.delenv("OPENGEM_GDPA_TUNE", raising=False)
    monkeypatch.setenv("OPENGEM_GDPA_GLUON", "auto")
    monkeypatch.setattr(triton_gdpa, "_TUNED", {})
    monkeypatch.setattr(triton_gdpa, "_TIMINGS", {})
    monkeypatch.setattr(triton_gdpa, "_CONFIRMED", {})
    _check([1024] * 8 + [512] * 8, [1024] * 8 + [512] * 8)
    forward = [r for r in triton_gdpa.tuning_report() if r["pass"] == "fwd"]
    assert len(forward) == 1
    timed = forward[0]["candidates"]
    label = triton_gdpa._label(triton_gdpa._GLUON_FWD)
    assert timed[label] is not None and len(timed) == len(triton_gdpa._FWD) * 2 + 1
