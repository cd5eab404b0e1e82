"""Single: every client trains alone (the "Single domain" row of pFedDB's tables)."""

from __future__ import annotations

from fedsilo.methods.sharing import PartialSharing
from fedsilo.models import LayeredNet


class Single(PartialSharing):
    """Each client trains its own model on its own data; nothing is sent. Every client starts from the same seeded
    initialisation as the federated methods and is evaluated with its own model."""

    name = "single"
    joinable = True  # one global (or shared) state and per-client stores only: a site may join mid-run

    def shared_keys(self, model: LayeredNet) -> list[str]:
        return []
