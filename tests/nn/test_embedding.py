"""EmbeddingCollection: outputs, fused optimizer updates vs plain autograd, checkpoints, bad input (CPU)."""

import io
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the Triton-backend test runs on CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from opengem.jagged import Jagged, KeyedJagged  # noqa: E402
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig  # noqa: E402

TABLES = (
    EmbeddingTableConfig("users", 11, 4, ("user", "friend")),
    EmbeddingTableConfig("items", 9, 5, ("history",), pooling="none"),
    EmbeddingTableConfig("cats", 6, 3, ("cat",), pooling="mean"),
)


def make_batch(batch_size: int, generator: torch.Generator, max_len: int = 4) -> KeyedJagged:
    keys = ("user", "friend", "history", "cat")
    rows = {"user": 11, "friend": 11, "history": 9, "cat": 6}
    lengths = torch.randint(0, max_len + 1, (len(keys), batch_size), generator=generator)
    # few rows per table -> many duplicate ids within a bag and across bags and features
    values = torch.cat(
        [torch.randint(0, rows[k], (int(lengths[i].sum()),), generator=generator) for i, k in enumerate(keys)]
    )
    return KeyedJagged(keys, values, lengths.flatten())


def expected_outputs(ec: EmbeddingCollection, batch: KeyedJagged) -> dict[str, torch.Tensor]:
    """Bag by bag, straight from the definition."""
    out = {}
    for table in ec.tables:
        weight = ec.embedding_weight(table.name).float()
        for feature in table.feature_names:
            bags = batch[feature].split()
            if table.pooling == "none":
                out[feature] = weight[batch[feature].values]
            else:
                rows = [weight[ids].sum(0) / (max(len(ids), 1) if table.pooling == "mean" else 1) for ids in bags]
                out[feature] = torch.stack(rows) if rows else torch.zeros(0, table.embedding_dim)
    return out


def values_of(x: torch.Tensor | Jagged) -> torch.Tensor:
    return x.values if isinstance(x, Jagged) else x


@pytest.mark.parametrize("batch_size", [0, 1, 5])
@pytest.mark.parametrize("optimizer", [EmbeddingOptimizer(), None])
def test_forward_matches_definition(batch_size: int, optimizer: EmbeddingOptimizer | None) -> None:
    g = torch.Generator().manual_seed(batch_size)
    ec = EmbeddingCollection(TABLES, optimizer=optimizer)
    batch = make_batch(batch_size, g)
    out = ec(batch)
    assert list(out) == ["user", "friend", "history", "cat"]
    for name, ref in expected_outputs(ec, batch).items():
        torch.testing.assert_close(values_of(out[name]), ref, rtol=1e-6, atol=1e-6)
    assert out["user"].shape == (batch_size, 4) and out["cat"].shape == (batch_size, 3)
    assert isinstance(out["history"], Jagged)
    torch.testing.assert_close(out["history"].lengths(), batch["history"].lengths())


def test_empty_bags_give_zero_and_mean_of_empty_is_zero() -> None:
    ec = EmbeddingCollection(TABLES)
    keys = ("user", "friend", "history", "cat")
    batch = KeyedJagged(keys, torch.tensor([3, 3, 1]), torch.tensor([0, 2, 0, 0, 0, 1, 0, 0]))
    out = ec(batch)
    assert torch.equal(out["user"][0], torch.zeros(4)) and torch.equal(out["cat"], torch.zeros(2, 3))
    torch.testing.assert_close(out["user"][1], 2 * ec.embedding_weight("users")[3])
    assert out["history"].values.shape == (1, 5) and out["history"].max_len == 1


def dense_step(weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], state: dict, opt: EmbeddingOptimizer):
    """Row-wise optimizers on the dense autograd gradient, restricted to rows with a nonzero gradient."""
    new = {}
    state["t"] = state.get("t", 0) + 1
    for name, w in weights.items():
        g = grads[name] + opt.weight_decay * w
        touched = grads[name].abs().sum(1) > 0
        if opt.kind == "sgd":
            update = opt.lr * g
        elif opt.kind == "rowwise_adagrad":
            acc = state.setdefault(name, torch.zeros(w.shape[0]))
            acc += torch.where(touched, g.pow(2).mean(1), 0.0)
            update = opt.lr * g / (acc.sqrt()[:, None] + opt.eps)
        else:
            b1, b2 = opt.betas
            m = state.setdefault(name + ".m", torch.zeros_like(w))
            v = state.setdefault(name + ".v", torch.zeros(w.shape[0]))
            m[touched] = b1 * m[touched] + (1 - b1) * g[touched]
            v[touched] = b2 * v[touched] + (1 - b2) * g[touched].pow(2).mean(1)
            t = state["t"]
            update = opt.lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt()[:, None] + opt.eps)
        new[name] = torch.where(touched[:, None], w - update, w)
    return new


@pytest.mark.parametrize(
    "opt",
    [
        EmbeddingOptimizer("rowwise_adagrad", lr=0.1),
        EmbeddingOptimizer("sgd", lr=0.5, weight_decay=0.1),
        EmbeddingOptimizer("rowwise_adam", lr=0.05, weight_decay=0.01),
    ],
    ids=lambda o: o.kind,
)
def test_fused_update_equals_optimizer_on_dense_gradient(opt: EmbeddingOptimizer) -> None:
    g = torch.Generator().manual_seed(0)
    fused = EmbeddingCollection(TABLES, optimizer=opt)
    plain = EmbeddingCollection(TABLES, optimizer=None)
    assert list(fused.parameters()) == []
    with torch.no_grad():
        for t in TABLES:
            plain.embedding_weight(t.name).copy_(fused.embedding_weight(t.name))
    state: dict = {}
    for _ in range(3):
        batch = make_batch(6, g)
        probes = {k: torch.randn(values_of(v).shape, generator=g) for k, v in fused(batch).items()}

        def loss(ec: EmbeddingCollection) -> torch.Tensor:
            return sum((values_of(v) * probes[k]).sum() for k, v in ec(batch).items())

        loss(fused).backward()
        plain.zero_grad()
        loss(plain).backward()
        weights = {t.name: plain.embedding_weight(t.name).detach() for t in TABLES}
        expected = dense_step(weights, {n: plain.embedding_weight(n).grad for n in weights}, state, opt)
        with torch.no_grad():
            for name, w in expected.items():
                plain.embedding_weight(name).copy_(w)
                torch.testing.assert_close(fused.embedding_weight(name), w, rtol=1e-5, atol=1e-6)


def test_duplicate_ids_give_one_adagrad_update_per_row() -> None:
    ec = EmbeddingCollection([EmbeddingTableConfig("t", 4, 2, ("a", "b"))], EmbeddingOptimizer(lr=1.0, eps=0.0))
    before = ec.embedding_weight("t").clone()
    batch = KeyedJagged(("a", "b"), torch.tensor([1, 1, 1]), torch.tensor([2, 1]))  # row 1 three times
    out = ec(batch)
    (out["a"].sum() + out["b"].sum()).backward()
    # aggregated gradient of row 1 is 3 in every column: state = 9, step = lr * 3 / 3 = 1
    assert torch.equal(ec.row_state_float32, torch.tensor([0.0, 9.0, 0.0, 0.0]))
    torch.testing.assert_close(ec.embedding_weight("t"), before - torch.tensor([[0.0], [1.0], [0.0], [0.0]]))


def test_checkpoint_round_trip_is_exact() -> None:
    opt = EmbeddingOptimizer("rowwise_adam", lr=0.1)
    tables = TABLES + (EmbeddingTableConfig("half", 7, 2, ("h",), dtype=torch.bfloat16),)
    first = EmbeddingCollection(tables, opt)

    def step(ec: EmbeddingCollection, batch: KeyedJagged) -> None:
        sum(values_of(v).float().pow(2).sum() for v in ec(batch).values()).backward()

    def batch_of(seed: int) -> KeyedJagged:
        kj = make_batch(3, torch.Generator().manual_seed(seed))
        return KeyedJagged.concat([kj, KeyedJagged(("h",), torch.tensor([1, 6, 6]), torch.tensor([1, 2, 0]))])

    step(first, batch_of(0))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    assert {"weights_float32", "row_state_float32", "elem_state_float32", "step_float32", "weights_bfloat16"} <= set(
        first.state_dict()
    )
    second = EmbeddingCollection(tables, opt)
    buffer.seek(0)
    second.load_state_dict(torch.load(buffer))
    for ec in (first, second):
        step(ec, batch_of(1))
    for key, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[key]), key
    assert int(second.step_float32) == 2


def test_optimizer_none_tables_are_parameters() -> None:
    ec = EmbeddingCollection(TABLES, optimizer=None)
    assert sorted(n for n, _ in ec.named_parameters()) == ["weights.0", "weights.1", "weights.2"]
    assert list(ec.fused_parameters()) == []


def test_model_dtype_casts_do_not_cast_tables_or_state() -> None:
    for optimizer in (EmbeddingOptimizer("rowwise_adam"), None):
        ec = EmbeddingCollection(TABLES, optimizer).to(torch.bfloat16).half()
        assert {t.dtype for t in ec.state_dict().values()} <= {torch.float32, torch.int64}
        out = ec(make_batch(2, torch.Generator().manual_seed(0)))
        assert out["user"].dtype == torch.float32


def test_init_std_and_dtype() -> None:
    torch.manual_seed(0)
    ec = EmbeddingCollection(
        [
            EmbeddingTableConfig("u", 1000, 8, ("a",)),
            EmbeddingTableConfig("n", 1000, 8, ("b",), init_std=0.5, dtype=torch.float16),
        ]
    )
    uniform, normal = ec.embedding_weight("u"), ec.embedding_weight("n")
    assert uniform.abs().max() <= 1 / 1000**0.5 and uniform.std() > 0.01
    assert normal.dtype == torch.float16 and 0.45 < float(normal.float().std()) < 0.55


def test_triton_backend_trains_like_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    opt = EmbeddingOptimizer("rowwise_adagrad", lr=0.2)
    reference_ec = EmbeddingCollection(TABLES, opt)
    triton_ec = EmbeddingCollection(TABLES, opt)
    triton_ec.load_state_dict(reference_ec.state_dict())
    batches = [make_batch(3, torch.Generator().manual_seed(seed)) for seed in range(2)]
    for ec, backend in ((reference_ec, "reference"), (triton_ec, "triton")):
        monkeypatch.setenv("OPENGEM_EMBEDDING_BACKEND", backend)
        for batch in batches:
            sum(values_of(v).pow(2).sum() for v in ec(batch).values()).backward()
    for key, value in reference_ec.state_dict().items():
        torch.testing.assert_close(triton_ec.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    assert int(triton_ec.step_float32) == 2


# --- bad input ------------------------------------------------------------------------------------------


def test_out_of_range_id_names_feature_position_and_id() -> None:
    ec = EmbeddingCollection(TABLES)
    keys = ("user", "friend", "history", "cat")
    with pytest.raises(ValueError, match=r"feature 'history': id 9 at position 1 is out of range \[0, 9\)"):
        ec(KeyedJagged(keys, torch.tensor([1, 2, 0, 9, 3]), torch.tensor([1, 1, 2, 1])))
    with pytest.raises(ValueError, match=r"feature 'user': id -1 at position 0"):
        ec(KeyedJagged(keys, torch.tensor([-1, 2, 0, 3]), torch.tensor([1, 1, 1, 1])))


def test_the_collection_checks_ids_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # its own IdCheck runs before any lookup; the op's CPU check of the same ids would be a second pass
    import opengem.ops.embedding as ops_embedding

    calls = []
    real = ops_embedding.check_ids
    monkeypatch.setattr(ops_embedding, "check_ids", lambda *args: calls.append(args) or real(*args))
    ec = EmbeddingCollection(TABLES)
    ec(KeyedJagged(("user", "friend", "history", "cat"), torch.tensor([1, 2, 0, 3, 3]), torch.tensor([1, 1, 2, 1])))
    assert calls == []


def test_bad_id_in_any_group_raises_before_any_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two weight groups (fp32, bf16): every group's ids are checked before the first lookup runs."""
    from opengem.nn import embedding as module

    tables = TABLES + (EmbeddingTableConfig("half", 7, 2, ("h",), dtype=torch.bfloat16),)
    keys = ("user", "friend", "history", "cat", "h")
    lookups = []
    monkeypatch.setattr(module, "embedding_lookup", lambda *args: lookups.append(args))
    for validate_ids in (True, False):  # on the CPU the check always runs
        ec = EmbeddingCollection(tables, validate_ids=validate_ids)
        with pytest.raises(ValueError, match=r"feature 'h': id 7 at position 1 is out of range \[0, 7\)"):
            ec(KeyedJagged(keys, torch.tensor([1, 2, 0, 3, 6, 7]), torch.tensor([1, 1, 1, 1, 2])))
    assert lookups == []


def test_trust_ids_turns_off_the_check_of_every_nested_collection() -> None:
    from opengem.nn import trust_ids

    model = torch.nn.ModuleDict({"a": EmbeddingCollection(TABLES), "deep": torch.nn.Sequential(EmbeddingCollection(TABLES))})
    assert all(m.validate_ids for m in model.modules() if isinstance(m, EmbeddingCollection))
    trust_ids(model)
    flags = [m.validate_ids for m in model.modules() if isinstance(m, EmbeddingCollection)]
    assert flags == [False, False]


def test_raise_bad_ids_reports_the_first_bad_check() -> None:
    from opengem.ops.embedding import IdCheck, raise_bad_ids

    good = IdCheck.start(torch.tensor([0, 2, 1]), torch.tensor([0, 1, 3]), 1, [1, 3], ["a", "b"])
    bad = IdCheck.start(torch.tensor([4, 5]), torch.tensor([0, 0, 2]), 1, [9, 5], ["c", "d"])
    empty = IdCheck.start(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0, [3], ["e"])
    raise_bad_ids([good, empty])
    raise_bad_ids([])
    with pytest.raises(ValueError, match=r"feature 'd': id 5 at position 1 is out of range \[0, 5\)"):
        raise_bad_ids([empty, good, bad])


def test_bad_batches_raise() -> None:
    ec = EmbeddingCollection(TABLES)
    with pytest.raises(ValueError, match=r"missing keys \['cat'\]"):
        ec(KeyedJagged(("user", "friend", "history"), torch.tensor([1, 2, 0]), torch.tensor([1, 1, 1])))
    keys = ("user", "friend", "history", "cat")
    with pytest.raises(ValueError, match="ids must be int32 or int64"):
        ec(KeyedJagged(keys, torch.tensor([1.0, 2.0, 0.0, 3.0]), torch.tensor([1, 1, 1, 1])))
    with pytest.raises(ValueError, match="lengths sum to 4 but there are 3 ids"):
        ec(KeyedJagged._trusted(keys, torch.tensor([1, 2, 0]), torch.tensor([1, 1, 1, 1]), None))
    with pytest.raises(ValueError, match="must be a KeyedJagged"):
        ec({"user": torch.tensor([1])})


def test_bad_configs_raise() -> None:
    with pytest.raises(ValueError, match="used by two tables"):
        EmbeddingCollection([EmbeddingTableConfig("a", 3, 2, ("x",)), EmbeddingTableConfig("b", 3, 2, ("x",))])
    with pytest.raises(ValueError, match="table names must be unique"):
        EmbeddingCollection([EmbeddingTableConfig("a", 3, 2, ("x",)), EmbeddingTableConfig("a", 3, 2, ("y",))])
    with pytest.raises(ValueError, match="pooling must be"):
        EmbeddingTableConfig("a", 3, 2, ("x",), pooling="max")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "adam"}, r"kind must be one of \['rowwise_adagrad', 'rowwise_adam', 'sgd'\], got 'adam'"),
    ({"lr": -1.0}, "lr must be > 0, got -1.0"),
    ({"lr": 0.0}, "lr must be > 0, got 0.0"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0, got -0.1"),
    ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"),
    ({"lr": float("inf")}, "lr must be finite, got inf"),  # the op's own checks, shared
    ({"lr": float("nan")}, "lr must be > 0, got nan"),
])
def test_bad_optimizer_settings_are_refused_when_made(kwargs, message) -> None:
    # a bad kind had surfaced only at the first training backward (never under no_grad)
    with pytest.raises(ValueError, match=message):
        EmbeddingOptimizer(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    # a bare str had become the features u, s, e, r
    ({"feature_names": "user"}, "table 't': feature_names must be a sequence of str, got 'user'"),
    ({"feature_names": ("a", 1)}, r"table 't': feature_names must be a sequence of str, got \('a', 1\)"),
    ({"init_std": -1.0}, "table 't': init_std must be None or a finite number >= 0, got -1.0"),  # had been torch's
    ({"init_std": float("nan")}, "table 't': init_std must be None or a finite number >= 0, got nan"),
    ({"init_std": float("inf")}, "table 't': init_std must be None or a finite number >= 0, got inf"),
])
def test_bad_table_configs_are_refused_naming_the_table(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EmbeddingTableConfig(**({"name": "t", "num_embeddings": 10, "embedding_dim": 4, "feature_names": ("a",)}
                                | kwargs))
    EmbeddingTableConfig("t", 10, 4, ["a", "b"], init_std=0.0)  # a list of names and a zero std are fine


def test_table_sizes_must_be_ints() -> None:
    with pytest.raises(ValueError, match="table 't': num_embeddings must be an int, got 4.5"):
        EmbeddingTableConfig("t", 4.5, 8, ("a",))
    with pytest.raises(ValueError, match="table 't': embedding_dim must be an int, got True"):
        EmbeddingTableConfig("t", 4, True, ("a",))
