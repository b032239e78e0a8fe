"""Per-step progress for `rolltap-trainer run`: a line per step, and TensorBoard scalars if asked.

Metrics also go to the database with each step (`training_steps.metrics`); this module
only shows them. TensorBoard is optional: used when `trainer.tensorboard_dir` is set and
`torch.utils.tensorboard` imports (it needs the `tensorboard` package).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from shared.settings import TrainerSettings
from trainer.loop import StepReport

__all__ = ["Progress"]

logger = logging.getLogger(__name__)

_COLUMNS = [("reward_mean", "reward", ".3f"), ("reward_std", "±", ".3f"), ("loss", "loss", ".4f"),
            ("kl", "kl", ".4f"), ("grad_norm", "grad", ".3f"), ("clip_frac", "clip", ".3f"),
            ("logprob_mismatch", "mismatch", ".4f"), ("tokens", "tokens", ".0f"), ("step_time_s", "s", ".2f")]


class Progress:
    def __init__(self, settings: TrainerSettings) -> None:
        self._max_steps = settings.max_steps
        self._writer: Any = None
        if settings.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("trainer.tensorboard_dir is set but tensorboard is not installed; skipping it")
            else:
                self._writer = SummaryWriter(settings.tensorboard_dir)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.close()

    def step(self, report: StepReport) -> None:
        parts = [f"step {report.step}/{self._max_steps}"]
        for key, label, fmt in _COLUMNS:
            value = report.metrics.get(key)
            if isinstance(value, (int, float)):
                parts.append(f"{label} {value:{fmt}}")
        print(" | ".join(parts), file=sys.stdout, flush=True)
        if self._writer is not None:
            for key, value in report.metrics.items():
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(f"rolltap/{key}", value, report.step)
