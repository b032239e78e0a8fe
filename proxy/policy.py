"""The active policy: which served model name recorded calls are rewritten to, and its version.

Version 0 is the replicas' base model. A trainer moves it forward through the admin
API; the record of each call carries the version active when the call started.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ActivePolicy"]


@dataclass(slots=True)
class ActivePolicy:
    version: int | None = None
    served_name: str | None = None

    @property
    def is_known(self) -> bool:
        return self.served_name is not None

    def set(self, version: int, served_name: str) -> None:
        # One assignment each; readers on the event loop never see a torn pair.
        self.version, self.served_name = version, served_name
