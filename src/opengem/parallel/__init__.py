"""5D parallelism applied to plain models from outside: meshes, FSDP2, expert parallelism, collectives, DCP."""

from opengem.parallel.checkpoint import ModelOptimizerState, load_distributed, save_distributed
from opengem.parallel.collectives import (
    Capabilities,
    CollectivePlan,
    CommStats,
    probe_capabilities,
    select_collectives,
    setup_environment,
)
from opengem.parallel.expert import ExpertParallel, all_gather_along_batch, gather_batch_sizes, reduce_scatter_along_batch
from opengem.parallel.fsdp import (
    FSDPUnit,
    clip_grad_norm_,
    data_parallel_loss,
    fsdp_step_bytes,
    is_sparse,
    parallelize,
)
from opengem.parallel.mesh import (
    ParallelConfig,
    ParallelMeshes,
    Topology,
    build_meshes,
    init_distributed,
    parse_parallel,
    validate_layout,
)
from opengem.parallel.sparse import ShardedEmbeddingCollection, shard_embeddings
from opengem.parallel.sparse_plan import Shard, ShardingPlan, TableSharding, plan_sharding, shard_table

__all__ = [
    "Capabilities",
    "CollectivePlan",
    "CommStats",
    "ExpertParallel",
    "FSDPUnit",
    "ModelOptimizerState",
    "ParallelConfig",
    "ParallelMeshes",
    "Topology",
    "all_gather_along_batch",
    "build_meshes",
    "clip_grad_norm_",
    "data_parallel_loss",
    "fsdp_step_bytes",
    "gather_batch_sizes",
    "init_distributed",
    "is_sparse",
    "load_distributed",
    "parallelize",
    "parse_parallel",
    "probe_capabilities",
    "reduce_scatter_along_batch",
    "save_distributed",
    "select_collectives",
    "setup_environment",
    "validate_layout",
    "ShardedEmbeddingCollection",
    "Shard",
    "ShardingPlan",
    "TableSharding",
    "plan_sharding",
    "shard_embeddings",
    "shard_table",
]
