"""``GEMConfig.embedding_dtype="bf16"``: the tables in bf16 (half their memory), their rows widened exactly where no
autocast casts them, trained with stochastically rounded row updates."""

import dataclasses

import pytest
import torch

from opengem.data.parquet import batches_from_table
from opengem.data.synthetic import generate
from opengem.models.gem import GEM
from tests.models.test_gem import DATA, SMALL, _model

FP32_TABLES = SMALL
BF16_TABLES = dataclasses.replace(FP32_TABLES, embedding_dtype="bf16")


def _twins() -> tuple[GEM, GEM]:
    """An fp32-table model and a bf16-table one with the same dense weights and the same table rows (the fp32
    model's rounded to bf16 in both)."""
    fp32, bf16 = _model(FP32_TABLES), _model(BF16_TABLES)
    dense = {k: v for k, v in fp32.state_dict().items() if not k.startswith("embeddings.")}
    bf16.load_state_dict(dense, strict=False)
    rows = fp32.embeddings.weights_float32.bfloat16()
    fp32.embeddings.weights_float32.copy_(rows)
    bf16.embeddings.weights_bfloat16.copy_(rows)
    return fp32, bf16


def test_bf16_tables_take_half_the_memory_and_give_the_fp32_models_logits():
    batch = next(iter(batches_from_table(generate(DATA, 48, seed=3), 48)))
    fp32, bf16 = _twins()
    assert 2 * bf16.embeddings.weights_bfloat16.nbytes == fp32.embeddings.weights_float32.nbytes
    assert not any(k.endswith("float32") and k.startswith("embeddings.weights") for k in bf16.state_dict())
    with torch.no_grad():  # no autocast: the rows widened exactly; but the lookup returns a pooled bag's fp32 sum
        # in the table's dtype, so multi-hot features reach the model rounded to bf16
        torch.testing.assert_close(bf16(batch), fp32(batch), rtol=2e-3, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast rounds the fp32 model's lookups alike: equal
        logits = bf16(batch)
        torch.testing.assert_close(logits, fp32(batch), rtol=0, atol=0)
    before = bf16.embeddings.weights_bfloat16.clone()
    logits.float().sum().backward()  # the fused update: rows of the batch move, in bf16
    after = bf16.embeddings.weights_bfloat16
    assert after.dtype == torch.bfloat16 and not torch.equal(after, before)


def test_an_unknown_embedding_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match=r"embedding_dtype must be one of \['bf16', 'fp32'\], got 'fp16'"):
        _model(dataclasses.replace(SMALL, embedding_dtype="fp16"))


def test_a_resumed_run_with_bf16_tables_continues_bit_for_bit(tmp_path):
    """The rows' rounding bits are keyed by the tables' step count, which the checkpoint keeps."""
    from tests.train.test_trainer import resume_matches_the_straight_run

    straight, middle, _ = resume_matches_the_straight_run(tmp_path, "architecture=gem", "precision=bf16",
                                                          "gem.embedding_dtype=bf16")
    state = torch.load(middle / "state.pt", weights_only=True)["learners"]["model"]["model"]
    assert state["embeddings.weights_bfloat16"].dtype == torch.bfloat16 and straight.gem.embedding_dtype == "bf16"
