"""EmbeddingCollection on the GPU (Triton kernels) against the same collection on the CPU (reference)."""

import warnings

import pytest
import torch

from opengem.jagged import Jagged, KeyedJagged
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2), torch.float16: (2e-3, 1e-3)}


def tables(dtype: torch.dtype) -> list[EmbeddingTableConfig]:
    return [
        EmbeddingTableConfig("small", 50, 64, ("s1", "s2"), dtype=dtype),  # few rows: many duplicates
        EmbeddingTableConfig("odd", 5000, 100, ("odd",), pooling="mean", dtype=dtype),  # dim not a power of 2
        EmbeddingTableConfig("wide", 20000, 256, ("wide",), dtype=dtype),
        EmbeddingTableConfig("history", 3000, 48, ("hist",), pooling="none", dtype=dtype),
    ]


def make_batch(configs: list[EmbeddingTableConfig], batch_size: int, seed: int, max_len: int = 100) -> KeyedJagged:
    g = torch.Generator().manual_seed(seed)
    keys, ids, lengths = [], [], []
    for config in configs:
        for feature in config.feature_names:
            feature_lengths = torch.randint(0, max_len + 1, (batch_size,), generator=g)
            feature_lengths[0] = 0  # always one empty bag
            keys.append(feature)
            lengths.append(feature_lengths)
            ids.append(torch.randint(0, config.num_embeddings, (int(feature_lengths.sum()),), generator=g))
    return KeyedJagged(tuple(keys), torch.cat(ids), torch.cat(lengths))


def values_of(x: torch.Tensor | Jagged) -> torch.Tensor:
    return x.values if isinstance(x, Jagged) else x


def twin(configs, optimizer) -> tuple[EmbeddingCollection, EmbeddingCollection]:
    cpu = EmbeddingCollection(configs, optimizer)
    gpu = EmbeddingCollection(configs, optimizer, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu


def assert_state_close(cpu: EmbeddingCollection, gpu: EmbeddingCollection, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    for key, value in cpu.state_dict().items():
        torch.testing.assert_close(gpu.state_dict()[key].cpu(), value, rtol=rtol, atol=atol, msg=key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch_size", [1, 33])
def test_forward_matches_cpu(dtype: torch.dtype, batch_size: int) -> None:
    cpu, gpu = twin(tables(dtype), EmbeddingOptimizer())
    batch = make_batch(tables(dtype), batch_size, seed=batch_size)
    with torch.no_grad():
        expected, out = cpu(batch), gpu(batch.to("cuda"))
    rtol, atol = TOLERANCE[dtype]
    for name, ref in expected.items():
        got = values_of(out[name])
        assert got.dtype == dtype and got.is_cuda
        torch.testing.assert_close(got.cpu(), values_of(ref), rtol=rtol, atol=atol, msg=name)
    assert torch.equal(out["s1"][0].float().cpu(), torch.zeros(64))  # the empty bag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_forward_config_matches_the_reference(dtype: torch.dtype) -> None:
    """Each tuning candidate of the forward, launched past the autotuner (which may pick any of them), on pooled
    sum / mean and sequence features of dims 64, 100, 256 and 48 (256-, 128- and 64-column tiles)."""
    from opengem.ops.embedding import LookupLayout
    from opengem.ops.reference import embedding as reference
    from opengem.ops.triton import embedding as kernels

    g = torch.Generator().manual_seed(5)
    dims, rows, poolings, batch_size = (64, 100, 256, 48), (50, 5000, 20000, 3000), ("sum", "mean", "sum", "none"), 37
    starts = [sum(d * r for d, r in zip(dims[:i], rows[:i])) for i in range(len(dims))]
    tables = [(start, sum(rows[:i]), r, d) for i, (start, r, d) in enumerate(zip(starts, rows, dims))]
    lengths = torch.randint(0, 101, (len(dims), batch_size), generator=g)
    ids = torch.cat([torch.randint(0, r, (int(n),), generator=g) for r, n in zip(rows, lengths.sum(1))])
    layout = LookupLayout.build(tables, range(len(dims)), poolings, lengths.sum(1).tolist(), batch_size, "cpu")
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.flatten().cumsum(0)])
    weights = torch.randn(sum(d * r for d, r in zip(dims, rows)), generator=g).to(dtype)
    expected = reference.embedding_lookup(weights.float(), layout.feature_meta, ids, offsets, batch_size, layout.out_numel)
    device_args = [t.cuda() for t in (weights, layout.feature_meta, ids, offsets)]
    sizes = (batch_size, layout.out_numel, layout.max_dim, layout.dim_align)
    rtol, atol = TOLERANCE[dtype]
    for config in kernels.lookup_configs():
        out = kernels.embedding_lookup(*device_args, *sizes, config)
        torch.testing.assert_close(out.float().cpu(), expected, rtol=rtol, atol=atol, msg=str(config))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "sgd", "rowwise_adam"])
def test_fused_training_matches_cpu(dtype: torch.dtype, kind: str) -> None:
    configs = tables(dtype)
    cpu, gpu = twin(configs, EmbeddingOptimizer(kind, lr=0.05, weight_decay=0.01))
    for step in range(3):
        batch = make_batch(configs, 16, seed=100 + step)
        for ec, device in ((cpu, "cpu"), (gpu, "cuda")):
            out = ec(batch.to(device))
            sum((values_of(v).float() * torch.linspace(-1, 1, values_of(v).shape[-1], device=device)).sum() for v in out.values()).backward()
    assert_state_close(cpu, gpu, dtype)
    assert list(gpu.parameters()) == []


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "rowwise_adam", "sgd", None])
def test_hot_row_many_duplicates(kind: str | None) -> None:
    """One row looked up 200000 times in one batch (a feature with a handful of categories read by every
    history token): a run of the sorted index thousands of times longer than a segment, through pass 1."""
    configs = [EmbeddingTableConfig("t", 10, 128, ("f",)), EmbeddingTableConfig("s", 10, 64, ("g",), pooling="none")]
    cpu, gpu = twin(configs, None if kind is None else EmbeddingOptimizer(kind, lr=0.1))
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.full((200000,), 3), torch.randint(0, 10, (100,), generator=g)])
    seq = torch.where(torch.rand(30000, generator=g) < 0.9, 7, torch.randint(0, 10, (30000,), generator=g))
    batch = KeyedJagged(("f", "g"), torch.cat([ids, seq]), torch.tensor([100000, 100050, 50, 10000, 0, 20000]))
    for ec, device in ((cpu, "cpu"), (gpu, "cuda")):
        out = ec(batch.to(device))
        # gradients in eighths: every partial sum of 200000 of them is exact in fp32 in any order, so the
        # CPU's serial sum and the GPU's segmented sum agree exactly
        eighths = {k: (torch.arange(d, device=device) % 16 - 8) / 8 for k, d in (("f", 128), ("g", 64))}
        sum((values_of(out[k]) * eighths[k]).sum() for k in eighths).backward()
    if kind is None:
        for p_cpu, p_gpu in zip(cpu.parameters(), gpu.parameters()):
            torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=0, atol=0)
    else:
        assert_state_close(cpu, gpu, torch.float32)


def test_dense_gradients_match_cpu() -> None:
    configs = tables(torch.float32)
    cpu, gpu = twin(configs, None)
    batch = make_batch(configs, 8, seed=7)
    for ec, device in ((cpu, "cpu"), (gpu, "cuda")):
        sum(values_of(v).pow(2).sum() for v in ec(batch.to(device)).values()).backward()
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_gpu_id_validation() -> None:
    configs = tables(torch.float32)
    checked = EmbeddingCollection(configs, device="cuda")
    batch = make_batch(configs, 4, seed=1, max_len=3)
    values = batch.values.clone()
    start = sum(batch.lengths_per_key()[:3])  # the first id of feature "wide"
    values[start + 1] = 20000
    bad = KeyedJagged(batch.keys, values, batch.lengths).to("cuda")
    with pytest.raises(ValueError, match=r"feature 'wide': id 20000 at position 1 is out of range \[0, 20000\)"):
        checked(bad)


def test_empty_batch_and_int32_ids() -> None:
    configs = tables(torch.float32)
    gpu = EmbeddingCollection(configs, device="cuda")
    keys = tuple(f for c in configs for f in c.feature_names)
    empty = KeyedJagged(keys, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)).to("cuda")
    out = gpu(empty)
    assert out["s1"].shape == (0, 64) and out["hist"].values.shape == (0, 48)
    batch = make_batch(configs, 5, seed=3)
    batch32 = KeyedJagged(batch.keys, batch.values.int(), batch.lengths.int()).to("cuda")
    with torch.no_grad():
        torch.testing.assert_close(gpu(batch32)["wide"], gpu(batch.to("cuda"))["wide"])


def sync_free_setup(validate_ids: bool) -> tuple[EmbeddingCollection, list[KeyedJagged]]:
    """Two weight groups (fp32 and bf16), pooled and sequence features, Adam (bias corrections on the device);
    batches moved with ``KeyedJagged.to`` (they carry the host mirror of their lengths); one warm-up step."""
    half = EmbeddingTableConfig("half", 1000, 32, ("h",), pooling="mean", dtype=torch.bfloat16)
    configs = [*tables(torch.float32), half]
    ec = EmbeddingCollection(configs, EmbeddingOptimizer("rowwise_adam"), device="cuda", validate_ids=validate_ids)
    batches = [make_batch(configs, 32, seed=seed).to("cuda") for seed in range(2)]
    train_step(ec, batches[0])  # Triton compiles outside the checked step
    torch.cuda.synchronize()
    return ec, batches


def train_step(ec: EmbeddingCollection, batch: KeyedJagged) -> None:
    out = ec(batch)
    sum(values_of(v).float().sum() for v in out.values()).backward()


def test_forward_backward_without_sync() -> None:
    ec, batches = sync_free_setup(validate_ids=False)
    before = ec.state_dict()["weights_bfloat16"].clone()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        train_step(ec, batches[1])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int(ec.step_float32) == 2 and int(ec.step_bfloat16) == 2
    assert not torch.equal(ec.state_dict()["weights_bfloat16"], before)  # the fused update ran


def test_id_validation_costs_one_sync() -> None:
    ec, batches = sync_free_setup(validate_ids=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(ec, batches[1])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # the exact message of a sync: set_sync_debug_mode's own "prototype feature" notice (once per process,
    # so only where this test is the worker's first to turn it on) also says "synchronizing"
    syncs = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 1, syncs


def test_bf16_rows_round_stochastically_as_on_the_cpu() -> None:
    """100 SGD steps each under half a bf16 ulp: the GPU kernel's row equals the CPU reference's bit for bit (the
    same fp32 arithmetic and the same rounding bits), and it moved, as rounded to nearest it would not."""
    from tests.nn.test_embedding_rounding import row_after_small_steps

    gpu = row_after_small_steps(True, device="cuda")
    assert torch.equal(gpu, row_after_small_steps(True)) and gpu.mean().item() < 0.995

