"""Training-step health: skip non-finite steps, stop after too many in a row, report loss spikes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from opengem.validation import is_int, is_number


def check_spike_factor(spike_factor: float) -> None:
    """A spike is a loss above ``spike_factor`` times its running mean: it must be a number > 1 (inf: never report;
    NaN had never reported one without a word)."""
    if not is_number(spike_factor) or not spike_factor > 1:
        raise ValueError(f"spike_factor must be > 1 (a multiple of the running mean loss), got {spike_factor!r}")


class TrainingDiverged(RuntimeError):
    """Raised when ``max_bad_steps`` consecutive steps produced a non-finite loss."""


@dataclass
class StepGuard:
    max_bad_steps: int
    spike_factor: float
    ema_decay: float = 0.98
    bad_in_a_row: int = 0
    skipped: int = 0
    spikes: int = 0
    _ema: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # max_bad_steps 0 stopped at the first bad step; a NaN spike_factor never reported a spike
        if not is_int(self.max_bad_steps) or self.max_bad_steps < 1:
            raise ValueError(f"max_bad_steps must be an int >= 1, got {self.max_bad_steps!r}")
        check_spike_factor(self.spike_factor)
        if not is_number(self.ema_decay) or not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay!r}")

    def check(self, step: int, loss: float) -> str | None:
        """Classify ``loss``: None (healthy), "skipped" (non-finite) or "spike" (finite but far above trend)."""
        if not math.isfinite(loss):
            self.bad_in_a_row += 1
            self.skipped += 1
            if self.bad_in_a_row >= self.max_bad_steps:
                raise TrainingDiverged(
                    f"step {step}: {self.bad_in_a_row} steps in a row had a non-finite loss ({loss}); "
                    "stopping. Lower the learning rate or resume from an earlier checkpoint."
                )
            return "skipped"
        self.bad_in_a_row = 0
        spike = self._ema is not None and loss > self.spike_factor * self._ema
        self._ema = loss if self._ema is None else self.ema_decay * self._ema + (1 - self.ema_decay) * loss
        if spike:
            self.spikes += 1
            return "spike"
        return None
