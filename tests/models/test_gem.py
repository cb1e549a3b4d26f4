"""GEM: shapes, gradients, ablations, domain heads, empty histories, training, FLOPs and presets."""

import argparse
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from opengem.cli.info import add_info_parser, run_info
from opengem.data.parquet import batches_from_table
from opengem.data.schema import TASKS, Batch
from opengem.data.synthetic import SYNTHETIC_PRESETS, generate
from opengem.jagged import Jagged, KeyedJagged, offsets_from_lengths
from opengem.models.gem import GEM, GEMConfig, prepend_reversed
from opengem.models.presets import GEM_PRESETS, describe, gem_flops
from opengem.models.sequence_ctr import SequenceCTRConfig, SequenceCTRModel
from opengem.nn.gem_layers import PersonalizedFFN, SeedPooling, SequenceSummary
from opengem.nn.wukong import DenseExperts
from opengem.train.bench.elementwise import ElementwiseBytes
from opengem.train.config import config_from_dict, load_config
from opengem.train.trainer import build_learner

DATA = SYNTHETIC_PRESETS["gem-tiny"]
SMALL = GEMConfig(embedding_dim=8, d_model=16, num_heads=2, num_layers=2, wukong_hidden=32, head_dims=(32,))


@pytest.fixture(scope="module")
def batch() -> Batch:
    return next(iter(batches_from_table(generate(DATA, 48, seed=3), 48)))


def _model(config: GEMConfig = SMALL, seed: int = 0) -> GEM:
    torch.manual_seed(seed)
    return GEM(DATA.feature_specs(), DATA.num_dense, config)


def _without_histories(batch: Batch, empty: torch.Tensor) -> Batch:
    """The batch with the histories of samples ``empty`` (bool ``[B]``) removed."""

    def drop(jagged: Jagged) -> Jagged:
        keep = ~empty[jagged.sample_ids()]
        return Jagged.from_lengths(jagged.values[keep], torch.where(empty, 0, jagged.lengths()))

    sequence = KeyedJagged.from_dict({key: drop(batch.sequence[key]) for key in batch.sequence.keys})
    return dataclasses.replace(batch, sequence=sequence, history_age=drop(batch.history_age))


@pytest.mark.parametrize("self_attention", ["jfa", "block"])
def test_forward_shape_and_finite(batch, self_attention):
    logits = _model(dataclasses.replace(SMALL, self_attention=self_attention, block_size=16))(batch)
    assert logits.shape == (batch.batch_size(), len(TASKS))
    assert torch.isfinite(logits).all()


def test_gradients_reach_every_parameter_and_the_tables(batch):
    model = _model(dataclasses.replace(SMALL, num_experts=2))
    tables_before = model.embeddings.weights_float32.clone()
    model(batch).sum().backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert parameter.grad.abs().sum() > 0, name
    assert not torch.equal(model.embeddings.weights_float32, tables_before)  # fused sparse update ran


@pytest.mark.parametrize(
    "flag, absent",
    [("use_sequence", SeedPooling), ("use_pffn", PersonalizedFFN), ("use_pooling", SeedPooling),
     ("use_wukong", DenseExperts)],
)  # fmt: skip
def test_each_ablation_removes_its_part(batch, flag, absent):
    full_config = dataclasses.replace(SMALL, num_experts=2)
    full, ablated = _model(full_config), _model(dataclasses.replace(full_config, **{flag: False}))
    assert any(isinstance(m, absent) for m in full.modules())
    assert not any(isinstance(m, absent) for m in ablated.modules())
    assert sum(p.numel() for p in ablated.parameters()) < sum(p.numel() for p in full.parameters())
    logits = ablated(batch)
    assert logits.shape == (batch.batch_size(), len(TASKS)) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(p.grad is not None for p in ablated.parameters())


def test_without_sequence_the_history_is_not_read(batch):
    model = _model(dataclasses.replace(SMALL, use_sequence=False))
    emptied = _without_histories(batch, torch.ones(batch.batch_size(), dtype=torch.bool))
    torch.testing.assert_close(model(batch), model(emptied))


def test_domain_heads_gather_the_sample_surface(batch):
    model = _model()
    every_domain = {}
    for task in TASKS:
        model.heads[task].register_forward_hook(lambda _m, _i, out, task=task: every_domain.__setitem__(task, out))
    logits = model(batch)
    surface = batch.sparse["surface"].values.long()
    assert every_domain["click"].shape == (batch.batch_size(), DATA.num_surfaces)
    assert len(set(surface.tolist())) > 1  # the check below distinguishes domains
    for t, task in enumerate(TASKS):
        torch.testing.assert_close(logits[:, t], every_domain[task][torch.arange(batch.batch_size()), surface])


@pytest.mark.parametrize("self_attention", ["jfa", "block"])
def test_zero_length_histories(batch, self_attention):
    model = _model(dataclasses.replace(SMALL, self_attention=self_attention, block_size=16))
    some = torch.arange(batch.batch_size()) % 3 == 0
    for empty in (some, torch.ones_like(some)):
        logits = model(_without_histories(batch, empty))
        assert torch.isfinite(logits).all()
        logits.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        model.zero_grad()


@pytest.mark.parametrize("num_seeds", [0, 2])
def test_sequence_summary_takes_cls_pooled_and_recent_rows(num_seeds):
    """``[CLS rows | seed-pooled | recent rows, zero past the history]`` per sample; the gradient reaches exactly
    the rows taken (histories shorter than, equal to and longer than the recent slots; the last sample short,
    so its missing slots fall past the end of the values)."""
    num_cls, num_recent, dim = 2, 3, 8
    torch.manual_seed(0)
    summary = SequenceSummary(dim, 2, num_cls, num_seeds, num_recent)
    lengths = torch.tensor([num_cls + 5, num_cls + 3, num_cls, num_cls + 1])
    values = torch.randn(int(lengths.sum()), dim, requires_grad=True)
    sequence = Jagged.from_lengths(values, lengths)
    out = summary(sequence)[0]

    starts = torch.cumsum(lengths, 0) - lengths
    expected_rows = []
    for start, length in zip(starts.tolist(), lengths.tolist()):
        recent = [values[start + num_cls + j] if num_cls + j < length else torch.zeros(dim) for j in range(num_recent)]
        expected_rows.append(torch.stack([values[start + j] for j in range(num_cls)] + recent))
    expected = torch.stack(expected_rows)
    if num_seeds:
        pooled = summary.pooling(sequence)
        expected = torch.cat([expected[:, :num_cls], pooled, expected[:, num_cls:]], dim=1)
    torch.testing.assert_close(out, summary.gate(expected), rtol=0, atol=0)

    grad = torch.randn_like(out)
    (taken,) = torch.autograd.grad(out, values, grad, retain_graph=True)
    (reference,) = torch.autograd.grad(summary.gate(expected), values, grad)
    torch.testing.assert_close(taken, reference, rtol=0, atol=0)
    if not num_seeds:  # only the CLS rows and the history rows inside the recent slots get a gradient
        touched = [s + j for s, n in zip(starts.tolist(), lengths.tolist()) for j in range(min(n, num_cls + num_recent))]
        untouched = torch.ones(values.shape[0], dtype=torch.bool)
        untouched[touched] = False
        assert taken[untouched].abs().sum() == 0 and (taken[touched].abs().sum(1) > 0).all()


@pytest.mark.parametrize("num_seeds", [0, 2])
def test_sequence_summary_adds_the_rows_gradient_into_the_pass_through(num_seeds, op_log):
    """The summary hands back the sequence to go on with: a use of it downstream gets the values' gradient summed
    with the taken rows', bit for bit as a plain gather plus that use would, and no zero ``[T, d]`` gradient is made
    for the rows (a plain gather's backward scatters into one)."""
    num_cls, num_recent, dim = 2, 3, 8
    torch.manual_seed(1)
    summary = SequenceSummary(dim, 2, num_cls, num_seeds, num_recent)
    lengths = torch.tensor([num_cls + 5, num_cls + 1, num_cls + 3])
    values = torch.randn(int(lengths.sum()), dim, requires_grad=True)
    sequence = Jagged.from_lengths(values, lengths)
    downstream, weights = torch.randn_like(values), torch.randn(3, summary.num_tokens, dim)
    with op_log:
        out, passed = summary(sequence)
        (got,) = torch.autograd.grad((out * weights).sum() + (passed.values * downstream).sum(), values)
    assert torch.equal(passed.values, values) and torch.equal(passed.offsets, sequence.offsets)
    zero_sizes = [math.prod(shape) for shape in op_log.shapes("zeros", "new_zeros", "zero_")]
    assert all(size < values.numel() for size in zero_sizes), zero_sizes
    # the same sums from a plain gather, the downstream use reading the values themselves
    slots = torch.arange(num_cls + num_recent)
    rows = (sequence.offsets[:-1].unsqueeze(1) + slots).clamp(max=values.shape[0] - 1)
    gathered = values[rows] * (slots < lengths.unsqueeze(1)).unsqueeze(2).float()
    parts = [gathered[:, :num_cls]] + ([summary.pooling(sequence)] if num_seeds else []) + [gathered[:, num_cls:]]
    plain = summary.gate(torch.cat(parts, dim=1))
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    (want,) = torch.autograd.grad((plain * weights).sum() + (values * downstream).sum(), values)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_few_row_lookup_gives_the_embeddings_gradient_by_one_gemm(grad_dtype, op_log):
    """The event-type and age tables' lookup: the rows of an embedding, and its gradient (fp32 sums of the rows'
    gradients by id) from the one-hot GEMM op, with no scatter of atomic adds."""
    from opengem.models.gem import _FewRowLookup

    torch.manual_seed(0)
    table = torch.randn(6, 16, requires_grad=True)
    ids = torch.randint(0, 5, (300,))  # the last row is never looked up: a zero gradient
    rows = _FewRowLookup.apply(table, ids)
    torch.testing.assert_close(rows, table[ids], rtol=0, atol=0)
    grad = torch.randn(300, 16).to(grad_dtype)
    with op_log:
        (got,) = torch.autograd.grad(rows.to(grad_dtype), table, grad)
    names = op_log.names()
    want = torch.zeros(6, 16, dtype=torch.float64).index_add_(0, ids, grad.double())
    assert got.dtype == torch.float32 and got[5].abs().sum() == 0
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert "few_row_grad" in names  # the one-hot GEMM, a custom op (FLOP counters skip it)
    assert not names & {"index_put", "index_put_", "index_add", "index_add_", "embedding_dense_backward"}, names


def test_prepend_reversed_layout():
    history = Jagged.from_lengths(torch.arange(5.0).unsqueeze(1), torch.tensor([3, 0, 2]))
    prefix = torch.full((3, 2, 1), -1.0)
    sequence, ages = prepend_reversed(history, history.values, prefix, torch.arange(5.0) + 10)
    assert sequence.offsets.tolist() == [0, 5, 7, 11] and sequence.max_len == 5
    assert sequence.values.squeeze(1).tolist() == [-1, -1, 2, 1, 0, -1, -1, -1, -1, 4, 3]
    assert ages.tolist() == [0, 0, 12, 11, 10, 0, 0, 0, 0, 14, 13]


def test_prepend_reversed_gradients_reach_each_placed_row():
    """Each history row's and prefix row's gradient is the gradient at the place it went to."""
    tokens = torch.randn(5, 3, requires_grad=True)
    prefix = torch.randn(3, 2, 3, requires_grad=True)
    history = Jagged.from_lengths(tokens.detach(), torch.tensor([3, 0, 2]))
    sequence, _ = prepend_reversed(history, tokens, prefix, torch.zeros(5))
    grad = torch.randn_like(sequence.values)
    grad_tokens, grad_prefix = torch.autograd.grad(sequence.values, (tokens, prefix), grad)
    # the layout of test_prepend_reversed_layout: the first sample's tokens 0, 1, 2 at rows 4, 3, 2, the third's
    # 3, 4 at 10, 9; the prefix rows at 0-1, 5-6 (the empty sample) and 7-8
    torch.testing.assert_close(grad_tokens, grad[[4, 3, 2, 10, 9]], rtol=0, atol=0)
    torch.testing.assert_close(grad_prefix, grad[[0, 1, 5, 6, 7, 8]].view(3, 2, 3), rtol=0, atol=0)


def test_short_training_run_lowers_the_loss(batch):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("self_attention", ["jfa", "block"])
def test_flop_formula_matches_flop_counter(batch, self_attention):
    config = dataclasses.replace(
        GEM_PRESETS["gem-tiny"].model, self_attention=self_attention, num_experts=2, num_layers=2
    )
    model = _model(config)
    with FlopCounterMode(display=False) as counter:
        model(batch)
    lengths = batch.history_age.lengths().tolist()
    expected = gem_flops(config, DATA, lengths)
    assert expected["attention"] > 0
    assert sum(expected.values()) == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_flop_formula_of_ablations_matches_flop_counter(batch):
    for flag in ("use_sequence", "use_pffn", "use_pooling", "use_wukong"):
        config = dataclasses.replace(GEM_PRESETS["gem-tiny"].model, num_layers=2, **{flag: False})
        with FlopCounterMode(display=False) as counter:
            _model(config)(batch)
        expected = gem_flops(config, DATA, batch.history_age.lengths().tolist())
        assert sum(expected.values()) == pytest.approx(counter.get_total_flops(), rel=0.02), flag


def test_presets_sizes_and_attention_share():
    expected_dense = {"gem-small": 100e6, "gem-large": 1e9, "gem-xl": 10e9}
    for name, dense in expected_dense.items():
        summary = describe(name)
        assert 0.8 * dense <= summary.dense_parameters <= 1.3 * dense, name
        assert summary.attention_share >= 0.15, name
        assert GEM_PRESETS[name].model.embedding_dim <= 256
    assert 0.8e12 <= describe("gem-xl").sparse_parameters <= 1.3e12
    assert GEM_PRESETS["gem-large"].data.max_history >= 8192
    assert describe("gem-tiny").dense_parameters < 2e6  # a CPU demo


def test_unknown_preset_and_bad_config_raise():
    with pytest.raises(ValueError, match="unknown GEM preset"):
        describe("gem-huge")
    with pytest.raises(ValueError, match="domain_feature"):
        GEM(DATA.feature_specs(), DATA.num_dense, dataclasses.replace(SMALL, domain_feature="hist_item"))
    with pytest.raises(ValueError, match="divisible"):
        GEM(DATA.feature_specs(), DATA.num_dense, dataclasses.replace(SMALL, num_heads=3))


@pytest.mark.parametrize(("change", "message"), [
    ({"num_heads": 0}, "num_heads must be >= 1, got 0"),
    ({"num_heads": 3}, "num_heads=3 must divide d_model=16"),
])
def test_bad_head_counts_are_refused_by_the_config(change, message):
    # refused when the config is made (opengem.train.config names the section: gem.num_heads), not at the build
    with pytest.raises(ValueError, match=message):
        GEMConfig(**{**dataclasses.asdict(SMALL), "head_dims": SMALL.head_dims, **change})


@pytest.mark.parametrize(("change", "message"), [
    ({"num_recent": -3}, "num_recent must be >= 0, got -3"),  # cut S_sum from 8 tokens to 1, silently
    ({"num_summary_tokens": 0}, "num_summary_tokens must be >= 1, got 0"),  # a ZeroDivisionError at the forward
    ({"num_heads": 0}, "num_heads must be >= 1, got 0"),  # a ZeroDivisionError in the divisibility check
    ({"ffn_mult": -1}, "ffn_mult must be >= 0, got -1"),  # ran as 0
    ({"num_seeds": 0}, "num_seeds must be >= 1, got 0"),
    ({"head_dims": (64, 0)}, r"head_dims must be sizes >= 1, got \(64, 0\)"),
])
def test_bad_sizes_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        GEM(DATA.feature_specs(), DATA.num_dense, dataclasses.replace(SMALL, **change))


@pytest.mark.parametrize("model_kind", ["gem", "sequence_ctr"])
def test_a_batch_the_model_cannot_read_is_named(batch, model_kind):
    model = (GEM(DATA.feature_specs(), DATA.num_dense, SMALL) if model_kind == "gem"
             else SequenceCTRModel(DATA.feature_specs(), DATA.num_dense, SequenceCTRConfig()))
    narrow = dataclasses.replace(batch, dense=batch.dense[:, :-1])  # was "mat1 and mat2 shapes cannot be multiplied"
    with pytest.raises(ValueError, match=rf"batch.dense must be \[B, {DATA.num_dense}\] \(the model's dense "
                                         rf"features\), got \(48, {DATA.num_dense - 1}\)"):
        model(narrow)
    with pytest.raises(ValueError, match=r"the batch is empty \(B = 0\)"):  # was a reshape error deep inside
        model(dataclasses.replace(batch, dense=batch.dense[:0]))
    ages = batch.history_age
    lengths = ages.lengths_host().clone()
    sample = int(torch.nonzero(lengths)[0])
    lengths[sample] -= 1  # one event short: was "The size of tensor a (99) must match the size of tensor b (98)"
    keep = torch.ones(ages.values.shape[0], dtype=torch.bool)
    keep[int(ages.offsets_host[sample])] = False
    short = Jagged.from_offsets(ages.values[keep], offsets_from_lengths(lengths))
    with pytest.raises(ValueError, match=rf"sample {sample}: history feature '\w+' has {int(lengths[sample]) + 1} "
                                         rf"events but history_age has {int(lengths[sample])}"):
        model(dataclasses.replace(batch, history_age=short))


def test_seeds_are_not_checked_without_pooling():
    model = GEM(DATA.feature_specs(), DATA.num_dense, dataclasses.replace(SMALL, num_seeds=0, use_pooling=False))
    assert model.config.num_seeds == 0


def test_trainer_builds_gem_and_keeps_the_history_free_baseline():
    config = load_config("gem-tiny", None, ["architecture=gem", "gem.num_layers=3", "gem.self_attention=block"])
    learner = build_learner(config, config.model.history, torch.device("cpu"))
    assert isinstance(learner.model, GEM)
    assert len(learner.model.layers) == 3 and learner.model.config.self_attention == "block"
    baseline = build_learner(config, "none", torch.device("cpu"))
    assert isinstance(baseline.model, SequenceCTRModel) and baseline.model.config.history == "none"
    assert isinstance(build_learner(load_config("gem-tiny"), "attention", torch.device("cpu")).model, SequenceCTRModel)
    with pytest.raises(ValueError, match="architecture"):
        build_learner(load_config("gem-tiny", None, ["architecture=dlrm"]), "attention", torch.device("cpu"))
    with pytest.raises(ValueError, match="expected one of"):
        load_config("gem-tiny", None, ["gem.self_attention=flash"])
    saved = json.loads(json.dumps(dataclasses.asdict(config)))  # as a checkpoint stores it
    assert config_from_dict(saved) == config


def test_info_prints_counts_and_flops(capsys):
    parser = argparse.ArgumentParser()
    add_info_parser(parser.add_subparsers(dest="command"))
    assert run_info(parser.parse_args(["info", "--preset", "gem-large"])) == 0
    out = capsys.readouterr().out
    summary = describe("gem-large")
    assert f"{summary.dense_parameters / 1e6:,.1f} M" in out and "attention share" in out
    assert "GEM_SPEC section 8" in out and "gem-tiny" not in out


def test_attention_backend_reference_is_the_cpu_default(batch):
    auto = _model(dataclasses.replace(SMALL, self_attention="block", block_size=16))
    forced = _model(dataclasses.replace(SMALL, self_attention="block", block_size=16, attention_backend="reference"))
    torch.testing.assert_close(forced(batch), auto(batch))


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_low_precision_self_attention_runs_its_emulation(batch, precision):
    """GEMConfig.attention_precision="fp8" / "mxfp8": the JFA self-attention in E4M3 (the CPU runs the exact
    emulation of the kernels); close to the bf16 model, not equal to it, and trainable."""
    config = dataclasses.replace(SMALL, d_model=64, num_heads=2)  # head_dim 32: the fp8 kernel's minimum
    plain, fp8 = _model(config), _model(dataclasses.replace(config, attention_precision=precision))
    out, out_fp8 = plain(batch), fp8(batch)
    assert not torch.equal(out_fp8, out)
    assert float((out_fp8 - out).detach().norm() / out.detach().norm()) < 0.05
    out_fp8.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in fp8.parameters() if p.grad is not None)
    with pytest.raises(ValueError, match="jfa self-attention only"):
        _model(dataclasses.replace(config, self_attention="block", attention_precision=precision))


def test_late_layers_keep_bf16_attention(batch):
    """``bf16_attention_last_layers=N``: the last N layers' self-attention in bf16, the others in the low precision;
    N = num_layers is the bf16 model bit for bit; N outside [0, num_layers] is refused with the range."""
    config = dataclasses.replace(SMALL, d_model=64, num_heads=2, num_layers=3, attention_precision="fp8")
    model = _model(dataclasses.replace(config, bf16_attention_last_layers=1))
    assert [layer.self_attention.precision for layer in model.layers] == ["fp8", "fp8", "bf16"]
    plain = _model(dataclasses.replace(config, attention_precision="bf16"))
    all_bf16 = _model(dataclasses.replace(config, bf16_attention_last_layers=3))
    assert torch.equal(all_bf16(batch), plain(batch))
    assert not torch.equal(model(batch), plain(batch)) and not torch.equal(model(batch), _model(config)(batch))
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=rf"bf16_attention_last_layers must be in \[0, num_layers = 3\], got {bad}"):
            _model(dataclasses.replace(config, bf16_attention_last_layers=bad))


@pytest.mark.parametrize("self_attention", ["jfa", "block"])
def test_sequence_stream_in_the_compute_dtype(batch, self_attention):
    """``sequence_dtype="compute"``: under bf16 autocast the sequence enters every layer in bf16, the
    element-wise ops move far fewer bytes, the activations saved for backward shrink (the norms' inputs),
    and logits and gradients stay within bf16 noise of the fp32 stream; without autocast nothing changes."""
    base = dataclasses.replace(SMALL, d_model=64, self_attention=self_attention, block_size=16)
    fp32_stream, compute_stream = _model(base), _model(dataclasses.replace(base, sequence_dtype="compute"))
    compute_stream.load_state_dict(fp32_stream.state_dict())
    seen = []
    for layer in compute_stream.layers:
        layer.self_attention.register_forward_pre_hook(lambda _, args: seen.append(args[0].values.dtype))

    def run(model):
        saved = []
        model.zero_grad()
        keep = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                        lambda t: t)
        with ElementwiseBytes() as moved:
            with keep, torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(batch).float()
            logits.sum().backward()  # the fused embedding update changes the tables: compare before it
        return logits.detach(), model.layers[0].self_attention.qkv.weight.grad.clone(), sum(saved), moved.total

    with torch.no_grad():  # no autocast: the option changes nothing
        torch.testing.assert_close(compute_stream(batch), fp32_stream(batch), rtol=0, atol=0)
    assert seen == [torch.float32] * SMALL.num_layers
    seen.clear()
    logits_fp32, grad_fp32, saved_fp32, moved_fp32 = run(fp32_stream)
    logits, grad, saved, moved = run(compute_stream)
    assert seen == [torch.bfloat16] * SMALL.num_layers
    assert moved < 0.75 * moved_fp32 and saved < 0.92 * saved_fp32
    assert (logits - logits_fp32).norm() <= 0.03 * logits_fp32.norm()
    assert (grad - grad_fp32).norm() <= 0.05 * grad_fp32.norm()
    with pytest.raises(ValueError, match="sequence_dtype"):
        _model(dataclasses.replace(base, sequence_dtype="bf16"))
