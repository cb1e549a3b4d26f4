"""The autotuner of opengem's kernels, and how many (kernel, key) configurations they have settled so far.

A kernel meeting a new tuning key (a new length bucket, mask or head dim) times every candidate on the
host before it runs: seconds, not milliseconds. Benchmarks warm up until this count stops growing, so no
tuning lands in a timed window (``opengem.train.bench.timing.warm_until_settled``).
"""

from __future__ import annotations

import math
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


def timed_window(warmup_ms: float, rep_ms: float) -> Callable:
    """An autotuner timer (``do_bench``) of one window: ``warmup_ms`` of runs, then ``rep_ms`` timed."""

    def bench(kernel_call, quantiles):
        import triton.testing

        return triton.testing.do_bench(kernel_call, warmup=warmup_ms, rep=rep_ms, quantiles=quantiles)

    bench.window_ms = (warmup_ms, rep_ms)
    return bench


# The first look at every candidate: shorter windows than Triton's default (25 / 100 ms), so that first calls on big
# batches tune faster.
tuning_bench = timed_window(10, 40)


def close_finalists(first_ms: dict, count: int, margin: float) -> list:
    """The candidates a second look times again, fastest first: of ``first_ms`` (candidate -> first-look ms;
    non-finite ones failed), the fastest, ties with it, and those among the ``count`` fastest within ``margin`` of
    it; empty when fewer than two qualify (a clear winner needs no second look)."""
    ranked = sorted((c for c, ms in first_ms.items() if math.isfinite(ms)), key=first_ms.__getitem__)
    if not ranked:
        return []
    best = first_ms[ranked[0]]
    chosen = [c for i, c in enumerate(ranked) if first_ms[c] == best or (i < count and first_ms[c] <= best * margin)]
    return chosen if len(chosen) >= 2 else []


class ConfirmingAutotuner(Autotuner):
    """Triton's autotuner (every candidate timed once, in one short window), then a second look at the finalists:
    the ``finalists`` fastest within ``margin`` of the best are timed again, one after the other, each after
    ``confirm_window_ms[0]`` ms of its own runs and over ``confirm_window_ms[1]`` ms, and the fastest of that look
    is the pick.

    Why: on a power-capped H200 one 40 ms window put tiles 2-16% above their rested times, unevenly, so between
    tiles within ~5% the pick was a coin flip: over five fresh tunings JFA's forward missed the fastest tile (timed
    hot: after 300 ms of the pass, a 100 ms window) by 5.3% once on workload (a) and by 10.4% once on (c), and in
    one process picked a tile 19% slower (session 27). Rested and hot timings ranked the tiles alike there, so a
    longer look at the few close candidates, in the hot regime a training step runs in, is what the first window
    lacks; three short rounds over every candidate (an interleaved tuner) did not help. Over six fresh tunings per
    JFA pass on workloads (a) and (c) this tuner stayed within 1.6% of the hot-fastest tile every time, where the
    one window missed (a)'s forward tile by 3.6-6.6% in three (session 28); it costs 0.4-0.6 s more a tuning key.

    ``configs_timings`` keeps the first look's quantiles, but a finalist's are its second look's scaled so that the
    pick sits at the first look's best (Triton takes the minimum); ``confirmed_timings`` holds the second look as
    measured. ``finalists = 1`` is Triton's one-window tuner.
    """

    finalists = 3
    margin = 1.10
    confirm_window_ms = (100, 100)

    @property
    def do_bench(self):  # (Triton caches its own on first use; the second look swaps the window)
        return self._do_bench

    def prune_configs(self, kwargs: dict) -> list:
        candidates = super().prune_configs(kwargs)
        self._candidates, self._timings = candidates, None  # a new tuning: the first _bench times them all
        return candidates

    def _bench(self, *args, config, **meta):
        if self._timings is None:
            self._timings = self._time_and_confirm(args, meta)
        return self._timings[id(config)]

    def _time_and_confirm(self, args: tuple, meta: dict) -> dict[int, list[float]]:
        """Each candidate's timing quantiles by ``id``, finalists' from the second look (see the class docstring)."""
        bench = super()._bench  # times one candidate in the window ``self._do_bench`` holds at the call
        timings = {id(c): list(bench(*args, config=c, **meta)) for c in self._candidates}
        by_id = {id(c): c for c in self._candidates}
        self.confirmed_timings = {}
        finalists = [by_id[i] for i in close_finalists({i: t[0] for i, t in timings.items()}, self.finalists,
                                                       self.margin)]
        if not finalists:
            return timings
        best = timings[id(finalists[0])][0]
        first_look = self._do_bench
        self._do_bench = timed_window(*self.confirm_window_ms)
        try:
            second = {id(c): list(bench(*args, config=c, **meta)) for c in finalists}
        finally:
            self._do_bench = first_look
        fastest = min(second[id(c)][0] for c in finalists)
        if not math.isfinite(fastest):  # every finalist failed its second look: the first look decides
            return timings
        for c in finalists:
            timings[id(c)] = [best * t / fastest for t in second[id(c)]]
        self.confirmed_timings = {c: second[id(c)] for c in finalists}
        return timings


def autotune(configs: list, key: list[str], reset_to_zero=None, restore_value=None, **kwargs) -> Callable:
    """``triton.autotune`` (same arguments but ``do_bench``, ``warmup``, ``rep``) with :class:`ConfirmingAutotuner`
    and :data:`tuning_bench` as its first look."""

    def decorator(fn) -> ConfirmingAutotuner:
        return ConfirmingAutotuner(fn, fn.arg_names, configs, key, reset_to_zero, restore_value, do_bench=tuning_bench,
                                   **kwargs)

    return decorator
