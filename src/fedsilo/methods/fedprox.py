"""FedProx (Li et al. 2020, MLSys)."""

from __future__ import annotations

from pydantic import Field

from fedsilo.methods.base import MethodParams
from fedsilo.methods.fedavg import FedAvg
from fedsilo.methods.terms import proximal_term


class FedProxParams(MethodParams):
    mu: float = Field(0.01, gt=0, description="proximal coefficient")


class FedProx(FedAvg):
    """FedAvg whose local objective adds (mu/2)||w - w^t||^2 over the trainable parameters, w^t being the model
    downloaded this round; the server averages as FedAvg does. (The paper's variable local work / partial solutions
    are not modelled: every sampled client runs the configured epochs, as in its main experiments.)"""

    name = "fedprox"
    joinable = True  # one global (or shared) state and per-client stores only: a site may join mid-run
    params_cls = FedProxParams
    params: FedProxParams

    def extra_loss(self, model, payload):
        return proximal_term(model, payload, self.params.mu)
