"""FedPer (Arivazhagan et al. 2019)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from fedsilo.methods.base import MethodParams
from fedsilo.methods.sharing import PartialSharing
from fedsilo.models import LayeredNet


class FedPerParams(MethodParams):
    head_layers: int = Field(1, ge=1, description="weighted layers at the top kept on the client (K_P)")


class FedPer(PartialSharing):
    """Base layers are trained federatedly (FedAvg over the base); the top ``head_layers`` weighted layers (the
    "personalization layers") never leave the client. Every client is evaluated with the global base plus its own
    head. The paper's personalization layers are the top fully connected layers; ``head_layers: 1`` keeps the
    classifier local, as pFedDB's comparison does."""

    name = "fedper"
    params_cls = FedPerParams
    params: FedPerParams

    def shared_keys(self, model: LayeredNet) -> list[str]:
        if self.params.head_layers >= model.num_layers:
            raise ValueError(f"methods.{self.key}.head_layers must be below the backbone's {model.num_layers} layers")
        k = model.cut_index(model.num_layers - self.params.head_layers)
        self.private_units = [model.unit_names[i] for i in range(k, len(model.units))]
        head = {f"units.{i}." for i in range(k, len(model.units))}
        return [key for key in model.state_dict() if not key.startswith(tuple(head))]

    def resolved(self) -> dict[str, Any]:
        return {**super().resolved(), "private_layers": getattr(self, "private_units", [])}
