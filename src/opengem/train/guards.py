"""Training-step health: skip non-finite steps, stop after too many in a row, report loss spikes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
