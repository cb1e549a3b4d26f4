"""HSTU / SASRec on the GPU (Triton hstu_attention / jagged_attention) against the same model on the CPU
reference ops, and a short GPU training run (skipped without CUDA)."""

import sys
from pathlib import Path

import pytest
import torch

from opengem.models.hstu import SequentialModelConfig, SequentialRecommender
from opengem.train.sequential import load_sequential_config, train_sequential

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from test_sequential import cyclic_inter  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("architecture", ["hstu", "sasrec"])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_gpu_matches_cpu_forward_and_gradients(architecture: str, head_dim: int) -> None:
    torch.manual_seed(0)
    config = SequentialModelConfig(architecture=architecture, num_items=500, dim=2 * head_dim, num_heads=2,
                                   max_len=200, dropout=0.0)  # fmt: skip
    cpu = SequentialRecommender(config)
    gpu = SequentialRecommender(config).cuda()
    gpu.load_state_dict(cpu.state_dict())
    lengths = [1, 0, 37, 200, 64, 129]
    items = torch.randint(1, 501, (sum(lengths),))
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    targets = torch.randint(1, 501, items.shape)
    negatives = torch.randint(1, 501, (64,))
    losses = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        states = model(items.to(device), offsets.to(device), max(lengths))
        loss = model.sampled_softmax_loss(states, targets.to(device), negatives.to(device))
        loss.backward()
        losses.append((states, loss))
    (cpu_states, cpu_loss), (gpu_states, gpu_loss) = losses
    assert _rel(gpu_states, cpu_states) < 1e-2
    assert abs(float(gpu_loss) - float(cpu_loss)) < 1e-2 * abs(float(cpu_loss))
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        assert _rel(p_gpu.grad, p_cpu.grad) < 3e-2, name


@pytest.mark.parametrize("model", ["hstu", "sasrec"])
def test_gpu_training_run_beats_popularity(tmp_path: Path, model: str) -> None:
    settings = {"data": cyclic_inter(tmp_path / "cycle.inter", users=64), "out_dir": tmp_path / "runs",
                "dim": 32, "num_layers": 1, "max_len": 16, "dropout": 0.0, "lr": 0.01, "batch_size": 16,
                "epochs": 8, "eval_every": 4, "in_batch_negatives": 8, "uniform_negatives": 16, "device": "cuda"}
    config = load_sequential_config(f"{model}-ml100k", [f"{k}={v}" for k, v in settings.items()])
    summary = train_sequential(config, progress=False)
    assert summary["test"]["ndcg@10"] > summary["popularity"]["test"]["ndcg@10"] + 0.3
