"""Per-step progress for `rolltap-trainer run`: a line per step, plus TensorBoard and W&B if asked.

Metrics also go to the database with each step (`training_steps.metrics`); this module
only shows them. Both trackers are optional and imported only when configured:
TensorBoard when `trainer.tensorboard_dir` is set (`torch.utils.tensorboard`, which needs
the `tensorboard` package), Weights & Biases when `trainer.wandb_project` is set (`wandb`;
its own `WANDB_*` variables choose entity and mode). A tracker that is configured but not
installed is skipped with a warning: it must never stop a training run.
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
            ("ppo_kl", "approx_kl", ".4f"), ("entropy", "entropy", ".3f"), ("tied_groups", "tied", ".0f"),
            ("logprob_mismatch", "mismatch", ".4f"), ("tokens", "tokens", ".0f"), ("step_time_s", "s", ".2f")]


class Progress:
    def __init__(self, settings: TrainerSettings) -> None:
        self._max_steps = settings.max_steps
        self._tensorboard: Any = None
        self._wandb: Any = None
        if settings.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("trainer.tensorboard_dir is set but tensorboard is not installed; skipping it")
            else:
                self._tensorboard = SummaryWriter(settings.tensorboard_dir)
        if settings.wandb_project:
            try:
                import wandb
            except ImportError:
                logger.warning("trainer.wandb_project is set but wandb is not installed; skipping it")
            else:
                config = settings.model_dump(mode="json", exclude={"admin_token"})
                self._wandb = wandb.init(project=settings.wandb_project, config=config)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=0 if exc[0] is None else 1)

    def step(self, report: StepReport) -> None:
        parts = [f"step {report.step}/{self._max_steps}"]
        for key, label, fmt in _COLUMNS:
            value = report.metrics.get(key)
            if isinstance(value, (int, float)):
                parts.append(f"{label} {value:{fmt}}")
        print(" | ".join(parts), file=sys.stdout, flush=True)
        scalars = {k: v for k, v in report.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(f"rolltap/{key}", value, report.step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log({f"rolltap/{key}": value for key, value in scalars.items()}, step=report.step)
