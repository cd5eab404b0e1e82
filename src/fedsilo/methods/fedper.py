"""FedPer (Arivazhagan et al. 2019)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveInt

from fedsilo.methods.base import MethodParams, per_backbone_type
from fedsilo.methods.sharing import PartialSharing, head_and_body_keys, per_backbone, top_units
from fedsilo.models import LayeredNet


class FedPerParams(MethodParams):
    head_layers: per_backbone_type(PositiveInt) = Field(
        1,
        description="weighted layers at the top kept on the client (K_P), with what rides in their units (the "
        "BatchNorm after a fully connected layer); a mapping backbone -> K_P for one methods block serving several "
        "backbones (e.g. {simple_cnn: 3, alexnet_bn: 3, densenet121: 1})",
    )


class FedPer(PartialSharing):
    """Base layers are trained federatedly (FedAvg over the base); the top ``head_layers`` weighted layers (the
    "personalization layers") never leave the client. Every client is evaluated with the global base plus its own
    head. The paper's personalization layers are the top fully connected layers; ``head_layers: 1`` keeps the
    classifier local.

    A unit of a backbone holds a weighted layer with its BatchNorm, so ``head_layers: 3`` on Simple-CNN keeps fc1,
    fc2, fc3 and the BatchNorm after fc1 and fc2 private: every fully connected layer and its BatchNorm, as the FedPer
    baseline of pFedDR's code runs it (github.com/CSU-YL/pFedDR, ``generalated/digits_fedper.py``: keys containing
    ``bn3``, ``bn4`` or ``fc`` are neither averaged nor sent back; in its ``DigitModel`` bn3 and bn4 follow fc1 and
    fc2). On FedBN's AlexNet the same rule (``office_fedper.py``, ``domainnet_fedper.py``: ``bn6``, ``bn7``, ``fc``)
    is ``head_layers: 3`` too. The convolutions' BatchNorm layers are averaged with the base, as there."""

    name = "fedper"
    joinable = True  # one global (or shared) state and per-client stores only: a site may join mid-run
    params_cls = FedPerParams
    params: FedPerParams

    def head_layers(self, model: LayeredNet) -> int:
        """K_P for the backbone being trained (``train.model`` picks the entry of a mapping)."""
        return per_backbone(self.params.head_layers, self.train.model, f"methods.{self.key}.head_layers")

    def shared_keys(self, model: LayeredNet) -> list[str]:
        self.cut = top_units(model, self.head_layers(model), f"methods.{self.key}.head_layers")
        self.private_units = model.unit_names[self.cut :]
        return head_and_body_keys(model, self.cut)[1]  # the body

    def resolved(self) -> dict[str, Any]:
        return {**super().resolved(), "private_layers": getattr(self, "private_units", [])}
