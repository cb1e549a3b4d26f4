"""The benchmarks' shared plumbing (benchmarks.common): the interleaved rounds, the paired speedup, the size lists,
the forced-config baselines."""

import pytest
import torch
import triton

import benchmarks.common as common
from benchmarks.common import fastest_forced, interleaved_ms, only_config, paired_speedup


def test_interleaved_rounds_rotate_the_order_and_keep_each_entry_in_round_order():
    order: list[str] = []
    clock = iter(range(100))

    def bench(fn) -> float:
        order.append(fn())
        return float(next(clock))  # a drifting card: every later call is slower

    times = interleaved_ms({name: (lambda n=name: n) for name in "abc"}, rounds=4, bench=bench)
    assert order == list("abc" "bca" "cab" "abc")
    assert times == {"a": [0.0, 5.0, 7.0, 9.0], "b": [1.0, 3.0, 8.0, 10.0], "c": [2.0, 4.0, 6.0, 11.0]}
    # the drift spreads over the entries: timed in sequence, c would have taken all the late slots
    assert max(sum(t) for t in times.values()) - min(sum(t) for t in times.values()) <= 2


def test_paired_speedup_is_the_median_of_per_round_ratios():
    assert paired_speedup([6.0, 5.0, 9.0], [3.0, 5.0, 3.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="equally many rounds"):
        paired_speedup([1.0, 2.0], [1.0])
    assert interleaved_ms({}, rounds=3, bench=lambda fn: 1.0) == {}  # every variant failed before timing
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        interleaved_ms({"a": lambda: None}, rounds=0, bench=lambda fn: 1.0)


def test_int_tuples_parses_sizes_and_refuses_a_malformed_entry_by_name():
    import argparse

    from benchmarks.common import int_tuples

    assert int_tuples("64x32x4x4,128x32x8x3", 4, "64x32x4x4") == [(64, 32, 4, 4), (128, 32, 8, 3)]
    assert int_tuples("16384x1024,", 2, "16384x1024") == [(16384, 1024)]
    for bad in ("64x32x4", "64x0x4x4", "64x-1x4x4", "64xax4x4"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            int_tuples(f"64x32x4x4,{bad}", 4, "64x32x4x4")


class _Tuner:
    """What only_config touches of a Triton autotuner: its candidates and its cache of picks."""

    def __init__(self, configs: list) -> None:
        self.configs, self.cache = configs, {("key",): configs[0]}


def test_only_config_restores_the_candidates_and_forgets_picks_even_on_error():
    configs = [triton.Config({"BLOCK_M": m}, num_warps=4, num_stages=3) for m in (64, 128)]
    tuner = _Tuner(configs)
    with pytest.raises(RuntimeError), only_config(tuner, configs[1]):
        assert tuner.configs == [configs[1]] and tuner.cache == {}
        tuner.cache[("key",)] = configs[1]
        raise RuntimeError("out of shared memory")
    assert tuner.configs == configs and tuner.cache == {}  # the forced pick is not left behind


def test_fastest_forced_skips_failing_candidates_and_names_the_fastest(monkeypatch):
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": 64}, num_warps=w, num_stages=3) for m, w in ((64, 4), (128, 8))]
    configs.append(triton.Config({"BLOCK_M": 256, "BLOCK_N": 64}, num_warps=8, num_stages=4))  # does not fit
    tuner = _Tuner(configs)
    times = {64: 2.0, 128: 1.5}

    def fn() -> None:
        if tuner.configs[0].kwargs["BLOCK_M"] == 256:
            raise RuntimeError("OutOfResources")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(common, "bench_ms", lambda f: times[tuner.configs[0].kwargs["BLOCK_M"]])
    assert fastest_forced(tuner, fn) == (1.5, "BLOCK_M128_BLOCK_N64_w8_s3")
    assert tuner.configs == configs


def test_config_labels_name_a_register_cap():
    capped = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=2, maxnreg=168)
    assert common.tuner_config_label(capped) == "BLOCK_M64_w4_s2_r168"
    assert common.tuner_config_label(triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=2)) == "BLOCK_M64_w4_s2"
