"""The autotuner of opengem's kernels, and how many (kernel, key) configurations they have settled so far.

A kernel meeting a new tuning key (a new length bucket, mask or head dim) times every candidate on the
host before it runs: seconds, not milliseconds. Benchmarks warm up until this count stops growing, so no
tuning lands in a timed window (``opengem.train.bench.timing.warm_until_settled``).
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable, Iterator

from triton.runtime.autotuner import Autotuner


def _autotuners() -> Iterator[tuple[str, Autotuner]]:
    """(name, autotuner) over the loaded ``opengem.ops.triton`` modules, the ones held in a module-level
    dict included (the FP8 row quantizers, one per column-block width)."""
    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(f"{__package__}."):
            continue
        for attribute, value in list(vars(module).items()):
            for label, tuner in _held(f"{name.rsplit('.', 1)[-1]}.{attribute}", value):
                if id(tuner) not in seen:  # one tuner can be both a module attribute and a table entry
                    seen.add(id(tuner))
                    yield label, tuner


def _held(label: str, value: object) -> list[tuple[str, Autotuner]]:
    """``value`` itself when it is an autotuner, the autotuners among its values when it is a dict."""
    if isinstance(value, Autotuner):
        return [(label, value)]
    if isinstance(value, dict):
        return [(f"{label}[{key}]", item) for key, item in value.items() if isinstance(item, Autotuner)]
    return []


def tuned_keys() -> int:
    """Settled configurations over the autotuned kernels of the loaded ``opengem.ops.triton`` modules
    (Triton's ``Autotuner`` caches and GDPA's own table). Host-side state: no device synchronization."""
    gdpa = sys.modules.get(f"{__package__}.gdpa")
    return sum(len(tuner.cache) for _, tuner in _autotuners()) + (gdpa.tuned_configs() if gdpa is not None else 0)


def tuned_key_names() -> set[str]:
    """The configurations `tuned_keys` counts, each named ``"kernel: key"``: the difference of two calls says
    which kernel met which new key."""
    names = {f"{label}: {key}" for label, tuner in _autotuners() for key in tuner.cache}
    gdpa = sys.modules.get(f"{__package__}.gdpa")
    return names | ({f"gdpa: {key}" for key in gdpa.tuned_key_list()} if gdpa is not None else set())


class InterleavedAutotuner(Autotuner):
    """Triton's autotuner, but the candidates of one tuning are timed in ``rounds`` rounds, each round starting one
    candidate later (A B C, B C A, C A B), and ranked by their median over the rounds.

    Why: Triton times each candidate once, right after compiling it, in one window. On a power-capped H200 the SM
    clock moves between 1400 and 1980 MHz within ~100 ms under attention, and the timings of one window sat 2-16%
    above the same tiles' rested times, unevenly: in one of two runs JFA's forward picked 64 x 32 on workload (a),
    which then ran 2.01 ms against 1.69 for 128 x 128 (session 27). Rounds after the first run back to back (no
    compile pauses), as training runs, and a candidate timed during a clock dip is out-voted by its other rounds.
    """

    rounds = 3
    window_ms = (5, 20)  # (warm-up, timed) per round: three short rounds cost 1.5x one 10 + 40 ms window

    def prune_configs(self, kwargs: dict) -> list:
        candidates = super().prune_configs(kwargs)
        self._candidates, self._timings = candidates, None  # a new tuning: the first _bench times them all
        return candidates

    @property
    def do_bench(self):
        return self._timed_window

    def _timed_window(self, kernel_call, quantiles):
        import triton.testing

        warmup, rep = self.window_ms
        return triton.testing.do_bench(kernel_call, warmup=warmup, rep=rep, quantiles=quantiles)

    def _bench(self, *args, config, **meta):
        if self._timings is None:
            self._timings = self._time_in_rounds(args, meta)
        return self._timings[id(config)]

    def _time_in_rounds(self, args: tuple, meta: dict) -> dict[int, list[float]]:
        """Each candidate's timing quantiles (median over rounds of each quantile), by ``id``; a candidate that
        failed (Triton's ``inf``: out of resources, a failed compile) is not tried again."""
        candidates = self._candidates
        runs: dict[int, list[list[float]]] = {id(c): [] for c in candidates}
        for r in range(self.rounds if len(candidates) > 1 else 1):
            shift = r % len(candidates)
            for config in candidates[shift:] + candidates[:shift]:
                done = runs[id(config)]
                if not (done and math.isinf(done[-1][0])):
                    done.append(list(super()._bench(*args, config=config, **meta)))
        return {key: [statistics.median(q) for q in zip(*done)] for key, done in runs.items()}


def autotune(configs: list, key: list[str], reset_to_zero=None, restore_value=None, **kwargs) -> Callable:
    """``triton.autotune`` (same arguments but ``do_bench``, ``warmup``, ``rep``) with :class:`InterleavedAutotuner`."""

    def decorator(fn) -> InterleavedAutotuner:
        return InterleavedAutotuner(fn, fn.arg_names, configs, key, reset_to_zero, restore_value, **kwargs)

    return decorator
