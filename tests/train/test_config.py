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
