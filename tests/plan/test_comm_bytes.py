"""Predicted bytes per collective equal what the distributed trainer reports (4-rank gloo run).

Reuses the 4-rank session of ``tests/train/test_distributed.py`` (``run_once`` with the same name: in a
full test run the session runs once for both modules).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
import distributed_runs as runs  # noqa: E402

from opengem.data.synthetic import SYNTHETIC_PRESETS  # noqa: E402
from opengem.parallel import parse_parallel  # noqa: E402
from opengem.parallel.sparse_plan import ROW_SPLIT_TYPES  # noqa: E402
from opengem.parallel.testing import run_once  # noqa: E402
from opengem.plan.comm import predicted_step_bytes, sparse_index_bytes  # noqa: E402
from opengem.plan.workload import workload_of  # noqa: E402
from opengem.train.distributed import sparse_plan  # noqa: E402
from opengem.train.trainer import build_model  # noqa: E402

WORLD = 4


@pytest.fixture(scope="module")
def world4(shared_dir: Path) -> dict[str, Any]:
    return run_once(shared_dir, "train_world4", runs.session_world4, WORLD, str(shared_dir / "distributed_train"))[0]


def test_predicted_bytes_equal_the_trainers(world4, tmp_path):
    config = runs.tiny_config(str(tmp_path), "predicted", "gem")
    layout = parse_parallel(runs.GEM_LAYOUT).resolved(WORLD)
    work = workload_of("tiny", config.gem, SYNTHETIC_PRESETS[config.data_preset])
    rank_batch = config.batch_size // WORLD
    predicted = predicted_step_bytes(work, layout, rank_batch, param_bytes=4, act_bytes=4)  # gloo: fp32
    plan = sparse_plan(build_model(config, config.model.history, "cpu"), config, layout.sparse_group)
    shards = {name: len(s.shards) for name, s in plan.tables.items()}
    rows = {name: s.sharding in ROW_SPLIT_TYPES for name, s in plan.tables.items()}
    sparse = sparse_index_bytes(layout, rank_batch, {}, shards, rows)
    predicted.update({k: v for k, v in sparse.items() if k[1] != "all_to_all_ids"})  # ids depend on the batch
    record = next(r for r in world4["gem"]["records"] if r.get("step") == 2 and "loss/model" in r)
    reported = {k: v for k, v in record.items() if k.startswith("comm/")}
    assert len(predicted) == 9  # shard AG/RS, replicate AR, expert AG/RS/sizes, world AR, sparse sizes/lengths
    for (dim, collective), nbytes in predicted.items():
        assert reported[f"comm/{dim}/{collective}_bytes"] == nbytes, (dim, collective)
