"""benchmarks.step_profile's run settings on the CPU: a ``set=KEY=VALUE`` flag reaches the config after the preset's
GEM model replaces the default one (issue 10's runs set ``gem.sequence_dtype=compute``), and a bad key is named."""

import pytest

from benchmarks.step_profile import config_for


def test_settings_reach_the_config_after_the_preset_model():
    default = config_for("gem-small", 2048, "bf16", compile_=True)
    stream = config_for("gem-small", 2048, "bf16", compile_=True, overrides=("gem.sequence_dtype=compute",))
    assert default.gem.sequence_dtype == "fp32" and stream.gem.sequence_dtype == "compute"
    assert stream.gem.d_model == default.gem.d_model and stream.batch_size == 2048 and stream.compile


def test_an_unknown_setting_is_named():
    with pytest.raises(ValueError, match="unknown setting 'gem.sequence_dtypes'"):
        config_for("gem-small", 2048, "bf16", overrides=("gem.sequence_dtypes=compute",))
