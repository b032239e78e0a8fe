"""Sampling on recorded routes: the deployment's pinned parameters, and one choice per call.

This module owns two checks on a tracked call's body, run where the relay parses it
(`Relay.parse`), before anything is sent upstream:

- `n` (and `best_of` on `/v1/completions`) above 1 is refused with a 400
  (`multiple_choices_not_supported`): a record holds one completion's token IDs and
  logprobs, and a training sample is one choice. Agents that want several samples of a
  prompt make several attempts (that is what a GRPO group is).
- `proxy.sampling.pinned` values are written into the body, so the recorded request
  says what the replica sampled with; a different value asked for by the agent is
  overridden or refused (`proxy.sampling.policy`, code `sampling_pinned`).

Untracked calls (`/v1/...`, evaluation traffic that is never trained on) are not checked.
"""

from __future__ import annotations

from typing import Any

from shared.errors import InvalidRequest
from shared.settings import SamplingSettings

__all__ = ["check_sampling"]


def check_sampling(settings: SamplingSettings, choice_fields: tuple[str, ...], body: dict[str, Any]) -> None:
    """Refuse several choices (any of `choice_fields`, the route's: `proxy.formats`) and apply the pinned
    parameters to `body` (in place); see the module docstring."""
    for name in choice_fields:
        value = body.get(name)
        if value is not None and value != 1:
            raise InvalidRequest(
                f"{name}={value!r}: a recorded call returns one choice, each a training sample of its own; "
                "make one attempt per sample (the attempts of a rollout form its group)",
                param=name,
                code="multiple_choices_not_supported",
            )
    for name, pinned in settings.pinned.items():
        asked = body.get(name)
        if asked is not None and asked != pinned and settings.policy == "reject":
            raise InvalidRequest(
                f"{name}={asked!r}: this deployment pins {name} to {pinned!r} (proxy.sampling.pinned)",
                param=name,
                code="sampling_pinned",
            )
        body[name] = pinned
