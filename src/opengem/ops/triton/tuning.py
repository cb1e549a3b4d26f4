"""How many (kernel, key) configurations opengem's autotuners have settled so far.

A kernel meeting a new tuning key (a new length bucket, mask or head dim) times every candidate on the
host before it runs: seconds, not milliseconds. Benchmarks warm up until this count stops growing, so no
tuning lands in a timed window (``opengem.train.bench.timing.warm_until_settled``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

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


def tuning_bench(kernel_call, quantiles):
    """The autotuners' timer: shorter windows than Triton's default (25 / 100 ms), so that first calls on big
    batches tune faster."""
    import triton.testing

    return triton.testing.do_bench(kernel_call, warmup=10, rep=40, quantiles=quantiles)
