import pytest

from opengem.train.config import apply_overrides, config_from_dict, load_config


def test_overrides_reach_nested_sections_and_convert_types(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = 7\nbaseline = false\n[model]\nnum_layers = 3\nmlp_dims = [32, 16]\n')
    config = load_config("gem-tiny", path, ["lr=0.5", "model.num_heads=4", "model.mlp_dims=8,4"])
    assert config.steps == 7 and config.baseline is False and config.lr == 0.5
    assert config.model.num_layers == 3 and config.model.num_heads == 4 and config.model.mlp_dims == (8, 4)


def test_config_round_trips_through_a_dict():
    import dataclasses

    config = apply_overrides(load_config("gem-tiny"), ["model.d_model=48", "seed=3"])
    assert config_from_dict(dataclasses.asdict(config)) == config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["nope=1"], "unknown setting 'nope'"),
        (["model.nope=1"], "unknown setting 'model.nope'"),
        (["steps=abc"], "steps"),
        (["baseline=maybe"], "expected true or false"),
        (["steps"], "expects key=value"),
        (["model=3"], "is a section"),
        (["lr=-1"], r"lr must be > 0, got -1.0"),
        (["lr=nan"], r"lr must be > 0, got nan"),
        (["embedding_lr=-1"], r"embedding_lr must be > 0, got -1.0"),  # trained without a word before
        (["weight_decay=-1"], r"weight_decay must be >= 0, got -1.0"),
        (["min_lr_ratio=5"], r"min_lr_ratio must be in \[0, 1\] \(a fraction of lr\), got 5.0"),
        (["spike_factor=0.5"], r"spike_factor must be > 1"),
    ],
)
def test_bad_overrides_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("gem-tiny", None, overrides)


def test_unknown_preset_and_bad_file(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'gem-nope'"):
        load_config("gem-nope")
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3")
    with pytest.raises(ValueError, match="cannot read config file .*bad.toml"):
        load_config(None, bad)


@pytest.mark.parametrize(("text", "message"), [
    ('[model]\nnum_heads = "two"\n', "run.toml: model.num_heads"),  # the section's prefix was lost
    ('[gem]\nnope = 1\n', "run.toml: unknown setting 'gem.nope'"),
    ('preset = "gem-huge"\n', "run.toml: unknown preset 'gem-huge'"),  # did not name the file
    ('lr = -1.0\n', "run.toml: lr must be > 0, got -1.0"),
])
def test_config_file_errors_name_the_file_and_the_full_key(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(None, path)


@pytest.mark.parametrize(("text", "message"), [
    ("steps = true\n", "run.toml: steps must be an int, got bool True"),  # was 1
    ("lr = true\n", "run.toml: lr must be a number, got bool True"),  # was 1.0
    ('steps = "12"\n', "run.toml: steps must be an int, got str '12'"),
    ("steps = 12.0\n", "run.toml: steps must be an int, got float 12.0"),
    ("data_dir = 1\n", "run.toml: data_dir must be a string, got int 1"),  # was "1"
    ("name = [1, 2]\n", r"run.toml: name must be a string, got list \[1, 2\]"),  # was "[1, 2]"
    ('compile = "false"\n', "run.toml: compile must be true or false, got str 'false'"),
    ("weight_shadows = 1\n", 'run.toml: weight_shadows must be true, false or "auto", got int 1'),
    ('[gem]\nself_attention = 1\n', r"run.toml: gem.self_attention must be one of \('jfa', 'block'\), got int 1"),
    ("[model]\nmlp_dims = [1.5, 2]\n", r"run.toml: model.mlp_dims must be a list of ints, got list \[1.5, 2\]"),
    ("[model]\nmlp_dims = [true, 2]\n", r"run.toml: model.mlp_dims must be a list of ints, got list \[True, 2\]"),
    ('[model]\nmlp_dims = "4,8"\n', "run.toml: model.mlp_dims must be a list of ints, got str '4,8'"),
    ("preset = 1\n", "run.toml: preset must be a string, got int 1"),
])
def test_config_file_values_must_have_their_settings_types(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(None, path)


def test_config_file_values_keep_their_types(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('lr = 1\nweight_shadows = "auto"\nprecision = "bf16"\n[gem]\nself_attention = "block"\n')
    config = load_config(None, path)
    assert config.lr == 1.0 and type(config.lr) is float  # an int is a number; stored as the float it stands for
    assert config.weight_shadows is None and config.gem.self_attention == "block"


@pytest.mark.parametrize(("value", "expected"), [
    ("8,4", (8, 4)), ("(8, 4)", (8, 4)), ("[8, 4]", (8, 4)), ("(8,)", (8,)), ("8", (8,)), ("()", ()),
])
def test_set_parses_int_tuples(value, expected):
    assert load_config("gem-tiny", None, [f"model.mlp_dims={value}"]).model.mlp_dims == expected


@pytest.mark.parametrize("value", ["1.5,2", "4,,8", "[4 8]", ",", "(4, 8]"])
def test_set_refuses_int_tuples_with_bad_entries(value):
    with pytest.raises(ValueError, match=r"--set: model.mlp_dims: expected integers separated by commas"):
        load_config("gem-tiny", None, [f"model.mlp_dims={value}"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["lr=inf"], "lr must be finite, got inf"),
    (["embedding_lr=inf"], "embedding_lr must be finite, got inf"),
    (["weight_decay=inf"], "weight_decay must be finite, got inf"),
    (["seed=-1"], r"seed must be in \[0, 2\*\*32\), got -1"),  # numpy's default_rng refuses negative seeds
    ([f"seed={2**32}"], r"seed must be in \[0, 2\*\*32\), got 4294967296"),
    (["name=../elsewhere"], r"name must be one folder name under out_dir .*got '\.\./elsewhere'"),
    (["name=a/b"], r"name must be one folder name under out_dir"),  # a run wrote outside its own folder
])
def test_rates_must_be_finite_and_seeds_in_range(overrides, message):
    with pytest.raises(ValueError, match=f"--set: {message}"):
        load_config("gem-tiny", None, overrides)
    assert load_config("gem-tiny", None, [f"seed={2**32 - 1}"]).seed == 2**32 - 1


def test_the_preset_is_chosen_by_preset_or_the_file_not_set(tmp_path):
    # --set preset=... used to rename the run and keep the old preset's batch, model and data
    with pytest.raises(ValueError, match=r"--set preset=gem-large: .* choose it with --preset NAME"):
        load_config("gem-tiny", None, ["preset=gem-large"])
    with pytest.raises(ValueError, match=r"--set preset=gem-large"):
        apply_overrides(load_config("gem-small"), ["preset=gem-large"])  # as --resume applies --set
    path = tmp_path / "run.toml"
    path.write_text('preset = "gem-large"\nsteps = 5\n')
    config = load_config(None, path)  # the file's preset is the base, its settings land on it
    assert (config.preset, config.batch_size, config.gem, config.steps) == (
        "gem-large", 128, load_config("gem-large").gem, 5)
    assert load_config("gem-large", path) == config  # --preset agreeing with the file
    with pytest.raises(ValueError, match=r"run.toml: preset = 'gem-large' disagrees with --preset gem-small"):
        load_config("gem-small", path)


def test_train_command_refuses_set_preset(capsys):
    from opengem.cli.main import main

    assert main(["train", "--no-progress", "--set", "preset=gem-large"]) == 2
    assert "--set preset=gem-large" in capsys.readouterr().err


@pytest.mark.parametrize(("overrides", "message"), [
    # these were found only when the trainer built the model or looked up the data, or (device) not at all
    (["architecture=foo"], r"--set: architecture must be one of \('sequence_ctr', 'gem'\), got 'foo'"),
    (["data_preset=foo"], r"--set: data_preset must be one of \[.*'gem-tiny'.*\], got 'foo'"),
    (["device=foo"], r"--set: device must be auto, cpu or cuda\[:N\], got 'foo'"),
    (["device=cuda:x"], r"--set: device must be auto, cpu or cuda\[:N\], got 'cuda:x'"),
    (["device=mps"], r"--set: device must be auto, cpu or cuda\[:N\], got 'mps'"),  # a torch device the trainer refuses
])
def test_names_are_checked_when_the_config_is_made(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("gem-tiny", None, overrides)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_a_well_formed_device_passes_without_that_device(device):
    # a config may be written on one machine for another: whether the GPU exists is the trainer's question
    assert load_config("gem-tiny", None, [f"device={device}"]).device == device


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.num_heads=3"], r"--set: model.num_heads=3 must divide d_model=64"),
    (["model.num_heads=0"], r"--set: model.num_heads must be >= 1, got 0"),
    (["model.dropout=2"], r"--set: model.dropout must be in \[0, 1\), got 2.0"),
    (["model.dropout=1"], r"--set: model.dropout must be in \[0, 1\), got 1.0"),
    (["gem.num_heads=0"], r"--set: gem.num_heads must be >= 1, got 0"),
    (["gem.num_heads=3"], r"--set: gem.num_heads=3 must divide d_model=64"),
])
def test_model_sections_are_checked_when_the_config_is_made(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("gem-tiny", None, overrides)


def test_model_section_errors_name_the_file_and_section(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nnum_heads = 3\n")
    with pytest.raises(ValueError, match=r"run.toml: model.num_heads=3 must divide d_model=64"):
        load_config(None, path)


def test_heads_need_not_divide_the_width_without_attention():
    config = load_config("gem-tiny", None, ["model.history=mean", "model.num_heads=3"])
    assert config.model.num_heads == 3  # the mean-pool model splits nothing into heads


def test_a_saved_config_with_a_bad_section_names_it():
    import dataclasses

    saved = dataclasses.asdict(load_config("gem-tiny"))
    saved["gem"]["num_heads"] = 3
    with pytest.raises(ValueError, match=r"saved config's gem.num_heads=3 must divide d_model=64"):
        config_from_dict(saved)


def test_infinite_spike_factor_and_numerics_bound_mean_never_report():
    # inf is documented: no loss is a spike, no layer's error passes the bound; NaN stays an error
    config = load_config("gem-tiny", None, ["spike_factor=inf", "numerics_bound=inf"])
    assert config.spike_factor == config.numerics_bound == float("inf")
    with pytest.raises(ValueError, match="--set: spike_factor must be > 1"):
        load_config("gem-tiny", None, ["spike_factor=nan"])
    with pytest.raises(ValueError, match="--set: numerics_bound must be > 0"):
        load_config("gem-tiny", None, ["numerics_bound=nan"])


@pytest.mark.parametrize(("flags", "named"), [
    (["--preset", "gem-small"], "--preset with --resume"),
    (["--config", "run.toml"], "--config with --resume"),
    (["--preset", "gem-small", "--config", "run.toml"], "--preset and --config with --resume"),
])
def test_train_command_refuses_preset_or_config_with_resume(capsys, tmp_path, flags, named):
    from opengem.cli.main import main

    # refused before the checkpoint is read: both were silently ignored, the checkpoint's settings winning
    assert main(["train", "--no-progress", "--resume", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{named}: a resumed run's config comes from its checkpoint" in err
    assert "--set KEY=VALUE (any setting but preset" in err
