"""opengem.parallel on one CUDA GPU with NCCL (world size 1): the same code as the multi-rank runs."""

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DIM = 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(DIM, DIM)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(expert(x) for expert in self.experts)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.experts = Experts()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x + self.experts(x))


@pytest.fixture(scope="module")
def meshes():
    import os

    import torch.distributed as dist

    from opengem.parallel import ParallelConfig, init_distributed
    from opengem.parallel.testing import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    meshes = init_distributed(ParallelConfig(activation_checkpointing=True))
    yield meshes
    dist.destroy_process_group()


def train(model: nn.Module, steps: int = 5) -> list[float]:
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(256, DIM, device="cuda", generator=generator)
    y = torch.randn(256, 1, device="cuda", generator=generator)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_nccl_world_size_one_trains_like_the_plain_model_in_bf16(meshes):
    from torch.distributed.fsdp import FSDPModule

    from opengem.parallel import parallelize

    assert meshes.device_type == "cuda"
    torch.manual_seed(0)
    reference = Model().cuda()
    torch.manual_seed(0)
    model = Model().cuda()
    units = parallelize(model, meshes, expert_types=(Experts,))
    assert isinstance(model.blocks[0], FSDPModule)
    # expert == 1: no expert parallelism; the experts' ModuleList children are ordinary blocks.
    assert [unit.name for unit in units] == ["blocks.0", "blocks.1", "blocks.2", "experts.experts.0", "<root>"]
    expected, got = train(reference), train(model)
    # bf16 compute (MixedPrecisionPolicy) against the fp32 model.
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=3e-2, atol=3e-3)


def test_collective_plan_on_this_machine(meshes):
    from opengem.parallel import probe_capabilities, select_collectives

    caps = probe_capabilities("nccl")
    assert caps.nccl_version is not None and caps.nccl_version[0] == 2
    plan = select_collectives("copy_engine", caps)
    print(f"NCCL {caps.nccl_version}: {plan}")
    if caps.nccl_version[:2] >= (2, 28) and caps.torch_has_cta_policy_zero:
        assert plan.nccl_zero_cta


def test_symmetric_memory_copy_engine_all_gather_route(meshes):
    from opengem.parallel.collectives import SYMM_MEM_COPY_ENGINE, enable_copy_engine_all_gather
    from opengem.parallel.expert import all_gather_along_batch, reduce_scatter_along_batch

    group = meshes.dense.get_group("shard")
    enable_copy_engine_all_gather(group)
    x = torch.randn(7, 16, device="cuda", requires_grad=True)
    gathered = all_gather_along_batch(x, group, route=SYMM_MEM_COPY_ENGINE)
    torch.testing.assert_close(gathered, x.detach())
    y = torch.randn(7, 16, device="cuda", requires_grad=True)
    out = reduce_scatter_along_batch(y, [7], group, route=SYMM_MEM_COPY_ENGINE)
    out.backward(torch.ones_like(out))  # backward all-gathers through the copy-engine route
    torch.testing.assert_close(y.grad, torch.ones_like(y))
