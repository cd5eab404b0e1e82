"""Single (local only), FedAvg, FedProx and FedBN."""

from __future__ import annotations

from pydantic import Field

from fedsilo.methods.base import MethodParams, PartialSharing, proximal_term
from fedsilo.models import LayeredNet, batchnorm_keys


class Single(PartialSharing):
    """Each client trains its own model on its own data; nothing is sent (the "Single domain" row of pFedDB's
    tables). Every client starts from the same seeded initialisation as the federated methods."""

    name = "single"

    def shared_keys(self, model: LayeredNet) -> list[str]:
        return []


class FedAvg(PartialSharing):
    """McMahan et al. 2017: clients download the global model, run E local epochs of SGD, upload the whole
    state_dict (parameters and BatchNorm statistics); the server takes the sample-size-weighted mean."""

    name = "fedavg"

    def shared_keys(self, model: LayeredNet) -> list[str]:
        return list(model.state_dict().keys())


class FedProxParams(MethodParams):
    mu: float = Field(0.01, gt=0, description="proximal coefficient")


class FedProx(FedAvg):
    """Li et al. 2020 (MLSys): FedAvg whose local objective adds (mu/2)||w - w_global||^2 over the trainable
    parameters, w_global being the model downloaded this round. (The paper's variable local work / partial
    solutions are not modelled: every sampled client runs the configured epochs, as in its main experiments.)"""

    name = "fedprox"
    params_cls = FedProxParams

    def extra_loss(self, model, payload):
        return proximal_term(model, payload, self.params.mu)  # type: ignore[attr-defined]


class FedBN(PartialSharing):
    """Li et al. 2021 (ICLR): FedAvg in which every BatchNorm layer (affine weight and bias, running mean and
    variance, batch counter) stays local; only the other tensors are uploaded and averaged."""

    name = "fedbn"

    def shared_keys(self, model: LayeredNet) -> list[str]:
        bn = batchnorm_keys(model)
        return [k for k in model.state_dict().keys() if k not in bn]
