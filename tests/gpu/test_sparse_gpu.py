"""ShardedEmbeddingCollection on one CUDA GPU with NCCL (group of one rank): the CUDA path of the
routing, the exchange (NCCL all-to-all), the column-wise row-state exchange and the Triton fused update,
against the unsharded collection on the same GPU."""

import os

import pytest
import torch

from opengem.jagged import Jagged, KeyedJagged
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TABLES = [
    EmbeddingTableConfig("users", 5000, 64, ("user",)),
    EmbeddingTableConfig("items", 3000, 100, ("item", "item_history"), pooling="mean"),
    EmbeddingTableConfig("tokens", 2000, 48, ("tokens",), pooling="none"),
]
OPTIMIZER = EmbeddingOptimizer("rowwise_adagrad", lr=0.05)


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist

    from opengem.parallel.testing import free_port

    owned = not dist.is_initialized()
    if owned:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


def batch(step: int, batch_size: int = 256) -> KeyedJagged:
    generator = torch.Generator().manual_seed(step)
    parts = {}
    for config in TABLES:
        for feature in config.feature_names:
            lengths = torch.randint(0, 30, (batch_size,), generator=generator)
            ids = torch.randint(0, config.num_embeddings, (int(lengths.sum()),), generator=generator)
            parts[feature] = Jagged.from_lengths(ids, lengths)
    return KeyedJagged.from_dict(parts).to("cuda")


def values(out) -> dict[str, torch.Tensor]:
    return {k: v.values if isinstance(v, Jagged) else v for k, v in out.items()}


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise", "replicated"])
def test_sharded_trains_like_unsharded_on_cuda(group, sharding):
    from opengem.parallel.sparse import ShardedEmbeddingCollection
    from opengem.parallel.sparse_plan import ShardingPlan, shard_table

    torch.manual_seed(0)
    reference = EmbeddingCollection(TABLES, OPTIMIZER, device="cuda")
    plan = ShardingPlan(1, {t.name: shard_table(t, sharding, [0]) for t in TABLES})
    sharded = ShardedEmbeddingCollection(TABLES, plan, group, OPTIMIZER, device="cuda")
    sharded.load_full_weights({t.name: reference.embedding_weight(t.name) for t in TABLES})
    for step in range(3):
        kj = batch(step)
        got, want = values(sharded(kj)), values(reference(kj))
        for feature in want:
            torch.testing.assert_close(got[feature], want[feature], rtol=1e-5, atol=1e-5)
        sum(v.pow(2).sum() for v in got.values()).backward()
        sum(v.pow(2).sum() for v in want.values()).backward()
    for name, table in sharded.full_weights().items():
        torch.testing.assert_close(table, reference.embedding_weight(name).cpu(), rtol=1e-4, atol=1e-5)
