"""Analytic step FLOPs against torch.utils.flop_counter, the device peak table and MFU."""

import dataclasses

import pytest
import torch

from opengem.data.parquet import batches_from_table
from opengem.data.schema import Batch
from opengem.data.synthetic import SYNTHETIC_PRESETS, generate
from opengem.models.gem import GEM
from opengem.models.presets import GEM_PRESETS, gem_flops
from opengem.models.sequence_ctr import SequenceCTRConfig, SequenceCTRModel
from opengem.train.flops import (
    DEVICE_PEAKS,
    batch_train_flops,
    device_peak_flops,
    measured_flops,
    measured_matmul_peak,
    mfu,
    train_flops,
)

DATA = SYNTHETIC_PRESETS["gem-tiny"]


@pytest.fixture(scope="module")
def batch() -> Batch:
    return next(iter(batches_from_table(generate(DATA, 40, seed=5), 40)))


def _gem(**changes) -> GEM:
    torch.manual_seed(0)
    config = dataclasses.replace(GEM_PRESETS["gem-tiny"].model, num_layers=2, num_experts=2, **changes)
    return GEM(DATA.feature_specs(), DATA.num_dense, config)


@pytest.mark.parametrize("self_attention", ["jfa", "block"])
def test_gem_analytic_train_flops_equal_the_flop_counter(batch, self_attention):
    model = _gem(self_attention=self_attention, block_size=16)
    count = batch_train_flops(model, batch)
    assert count.train == measured_flops(model, batch)
    # the forward part is the preset formula; the train count adds 2x GEMMs (less the dense input) + 2.5x attention
    forward = gem_flops(model.config, DATA, batch.history_age.lengths().tolist())
    assert (count.gemm, count.attention) == (forward["gemm"], forward["attention"])
    assert 3 * count.gemm + 3.5 * count.attention - count.train == 2 * 40 * DATA.num_dense * model.config.d_model
    assert 0 < count.attention_share < 1


@pytest.mark.parametrize("flag", ["use_sequence", "use_pffn", "use_pooling", "use_wukong"])
def test_gem_ablation_flops_equal_the_flop_counter(batch, flag):
    model = _gem(**{flag: False})
    assert batch_train_flops(model, batch).train == measured_flops(model, batch)


@pytest.mark.parametrize("history", ["attention", "mean", "none"])
def test_sequence_ctr_flops_equal_the_flop_counter(batch, history):
    torch.manual_seed(0)
    model = SequenceCTRModel(DATA.feature_specs(), DATA.num_dense, SequenceCTRConfig(history=history))
    count = batch_train_flops(model, batch)
    assert count.train == measured_flops(model, batch)
    assert (count.attention > 0) == (history == "attention")


def test_flops_grow_with_history_and_reject_unknown_models(batch):
    model = _gem()
    short, long = train_flops(model, [10, 10]), train_flops(model, [10, 200])
    assert long.gemm > short.gemm and long.attention > short.attention
    with pytest.raises(TypeError, match="no FLOP formula for Linear"):
        train_flops(torch.nn.Linear(2, 2), [1])


def test_device_table_matches_cuda_device_names():
    cases = {
        "NVIDIA H200": 989e12,
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA A100-PCIE-40GB": 312e12,
        "NVIDIA B200": 2250e12,
        "NVIDIA GB200": 2500e12,
    }
    for name, peak in cases.items():
        assert device_peak_flops(name) == peak, name
    assert device_peak_flops("NVIDIA H200", "fp8") == 1979e12
    assert all(p.bf16_tflops > 0 for p in DEVICE_PEAKS.values())


def test_unknown_device_needs_an_explicit_peak():
    with pytest.raises(ValueError, match="unknown device 'Mystery GPU'.*--peak-tflops"):
        device_peak_flops("Mystery GPU")
    assert device_peak_flops("Mystery GPU", peak_tflops=100.0) == 100e12
    with pytest.raises(ValueError, match="no fp8 tensor cores"):
        device_peak_flops("NVIDIA A100-SXM4-80GB", "fp8")
    with pytest.raises(ValueError, match="precision must be"):
        device_peak_flops("NVIDIA H200", "fp4")


def test_mfu_and_measured_ceiling_on_cpu():
    assert mfu(494.5e12, 989e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak_flops must be positive"):
        mfu(1.0, 0.0)
    peak = measured_matmul_peak("cpu", torch.float32, size=128, repeats=2)
    assert 1e6 < peak < 1e14
