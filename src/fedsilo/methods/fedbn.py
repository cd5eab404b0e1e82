"""FedBN (Li et al. 2021, ICLR)."""

from __future__ import annotations

from typing import Any

from fedsilo.config import ConfigError
from fedsilo.methods.sharing import PartialSharing
from fedsilo.models import LayeredNet, batchnorm_keys


class FedBN(PartialSharing):
    """FedAvg in which every BatchNorm layer (affine weight and bias, running mean and variance, batch counter) stays
    on the client; only the other tensors are uploaded and averaged. Each client is evaluated with the global
    tensors plus its own BatchNorm."""

    name = "fedbn"
    joinable = True  # one global (or shared) state and per-client stores only: a site may join mid-run

    def check_backbone(self, model, example):
        super().check_backbone(model, example)
        if not batchnorm_keys(model):  # nothing would stay home: FedAvg under FedBN's name
            raise ConfigError(f"methods.{self.key}: FedBN keeps each client's BatchNorm layers at home, and this backbone "
                              "has none: its runs would be FedAvg's (choose a backbone with BatchNorm, e.g. simple_cnn, "
                              "alexnet_bn, a ResNet)")

    def shared_keys(self, model: LayeredNet) -> list[str]:
        bn = batchnorm_keys(model)
        return [k for k in model.state_dict().keys() if k not in bn]

    def resolved(self) -> dict[str, Any]:
        out = super().resolved()
        if hasattr(self, "private"):
            out["private_layers"] = sorted({k.rsplit(".", 1)[0] for k in self.private})
        return out
