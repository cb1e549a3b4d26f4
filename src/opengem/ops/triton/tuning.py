"""How many (kernel, key) configurations opengem's autotuners have settled so far.

A kernel meeting a new tuning key (a new length bucket, mask or head dim) times every candidate on the
host before it runs: seconds, not milliseconds. Benchmarks warm up until this count stops growing, so no
tuning lands in a timed window (``opengem.train.bench.timing.warm_until_settled``).
"""

from __future__ import annotations

import sys

from triton.runtime.autotuner import Autotuner


def tuned_keys() -> int:
    """Settled configurations over the autotuned kernels of the loaded ``opengem.ops.triton`` modules
    (Triton's ``Autotuner`` caches and GDPA's own table). Host-side state: no device synchronization."""
    count = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(f"{__package__}."):
            continue
        for value in vars(module).values():
            if isinstance(value, Autotuner):
                count += len(value.cache)
    gdpa = sys.modules.get(f"{__package__}.gdpa")
    return count + (gdpa.tuned_configs() if gdpa is not None else 0)


def tuning_bench(kernel_call, quantiles):
    """The autotuners' timer: shorter windows than Triton's default (25 / 100 ms), so that first calls on big
    batches tune faster."""
    import triton.testing

    return triton.testing.do_bench(kernel_call, warmup=10, rep=40, quantiles=quantiles)
