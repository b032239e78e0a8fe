"""What a recorded call's sampling parameters mean for training: its temperature, and whether it can be reproduced.

The request JSON the proxy records holds the sampling parameters the replica used
(`temperature`, `top_p`, `top_k`, `min_p`, `n`; pinned by `proxy.sampling` when the
deployment sets them). The update recomputes each sample's logprobs under the current
policy at that sample's temperature (verl's engine divides the logits by it per row).
What it does not recompute is the truncation of the distribution: `top_p < 1`,
`top_k > 0` and `min_p > 0` sample from a renormalised subset of the vocabulary the
trainer's logprobs know nothing about, and greedy decoding (temperature 0) has no
sampling distribution at all. Such calls are *not reproducible*: dropped with the reason
`sampling_not_reproducible` by default (`trainer.unreproducible_sampling = "drop"`), or
trained at their temperature with the truncation ignored (`"keep"`; the truncated
importance weights then absorb part of the gap, see docs/trainer.md).

Pure: no database, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_TEMPERATURE", "GREEDY_EPS", "CallSampling", "call_sampling"]

# vLLM's default when neither the request nor the model's generation config sets one.
DEFAULT_TEMPERATURE = 1.0
# vLLM treats temperatures below this as greedy decoding (`_SAMPLING_EPS`).
GREEDY_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class CallSampling:
    """A call's temperature and, when it cannot be reproduced, why (`problem`)."""

    temperature: float
    problem: str | None = None

    @property
    def is_reproducible(self) -> bool:
        return self.problem is None


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def call_sampling(request: Any) -> CallSampling:
    """The sampling of one recorded request body (a JSON object; anything else reads as the defaults)."""
    body = request if isinstance(request, dict) else {}
    temperature = _number(body, "temperature")
    temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    if temperature < GREEDY_EPS:
        return CallSampling(temperature, f"temperature {temperature:g}: greedy decoding has no sampling distribution")
    problems = []
    top_p = _number(body, "top_p")
    if top_p is not None and top_p < 1.0:
        problems.append(f"top_p {top_p:g}")
    top_k = _number(body, "top_k")
    if top_k is not None and top_k > 0:
        problems.append(f"top_k {top_k:g}")
    min_p = _number(body, "min_p")
    if min_p is not None and min_p > 0.0:
        problems.append(f"min_p {min_p:g}")
    if problems:
        return CallSampling(temperature, ", ".join(problems) + ": a truncated distribution the update cannot recompute")
    return CallSampling(temperature)
