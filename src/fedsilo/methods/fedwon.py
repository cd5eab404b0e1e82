"""FedWon (Zhuang and Lyu 2024, ICLR): multi-domain FL without normalization layers."""

from __future__ import annotations

from typing import Any, Callable

import torch
from pydantic import Field
from torch import nn

from fedsilo.methods.base import MethodParams
from fedsilo.methods.fedavg import FedAvg
from fedsilo.models import LayeredNet, normalization_free


class FedWonParams(MethodParams):
    clip: float = Field(1.28, gt=0, description="AGC clipping threshold lambda (unit-wise max ||G|| / ||W||)")
    agc_eps: float = Field(1e-3, gt=0, description="AGC's floor on the weight norm")


def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """Brock et al. 2021b: the norm of each output unit (row of a linear weight, filter of a conv); vectors and
    scalars (biases, gains) as one unit."""
    if x.dim() <= 1:
        return x.norm()
    return x.flatten(1).norm(dim=1).view(-1, *([1] * (x.dim() - 1)))


def adaptive_grad_clip(params: list[nn.Parameter], clip: float, eps: float = 1e-3) -> None:
    """AGC (Brock et al. 2021b, Eq. 3): a unit's gradient G_i is rescaled to clip * max(||W_i||, eps) / ||G_i||
    of itself wherever ||G_i|| / max(||W_i||, eps) exceeds ``clip``."""
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            max_norm = unitwise_norm(p.detach()).clamp_min(eps) * clip
            g_norm = unitwise_norm(p.grad).clamp_min(1e-6)
            p.grad.mul_(torch.where(g_norm > max_norm, max_norm / g_norm, torch.ones_like(g_norm)))


class FedWon(FedAvg):
    """FedWon (Zhuang and Lyu 2024, ICLR, "FedWon: Triumphing Multi-domain Federated Learning Without
    Normalization"): the backbone without any normalization layer, every convolution reparameterized with scaled
    weight standardization (Eq. 1, :class:`fedsilo.models.WSConv2d`, with its learnable per-channel gain), trained
    with SGD plus adaptive gradient clipping (AGC) and aggregated with FedAvg over all parameters. Every client is
    evaluated with the global model.

    Choices: the final classifier layer is not clipped, as Brock et al. recommend for AGC; the threshold is a
    parameter because FedWon tunes it per dataset (default 1.28, set it in the preset). Fully connected layers keep
    plain weights (FedWon reparameterizes convolutions only); the BatchNorm layers of the fully connected part
    (FedBN's AlexNet and digit CNN) are removed like the others."""

    name = "fedwon"
    joinable = True  # one global model: a site may join mid-run
    task_stream = False  # not one of the continual papers' baselines
    params_cls = FedWonParams
    params: FedWonParams

    def transform_model(self, model: nn.Module, example: torch.Tensor) -> nn.Module:
        if not isinstance(model, LayeredNet):
            raise TypeError("fedwon needs a LayeredNet backbone")
        return normalization_free(model)

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        last = [m for m in model.head().modules() if isinstance(m, nn.Linear)]
        skip = {id(p) for p in last[-1].parameters()} if last else set()
        # by name: the parameters are those of the model each client trains (a copy when clients train in parallel)
        self.clipped = [n for n, p in model.named_parameters() if id(p) not in skip]

    def local_terms(self, model, payload, client, rnd, seed, store) -> dict[str, Any]:
        named = dict(model.named_parameters())
        clip, eps, params = self.params.clip, self.params.agc_eps, [named[n] for n in self.clipped]
        hook: Callable[[], None] = lambda: adaptive_grad_clip(params, clip, eps)  # noqa: E731
        return {"grad_hook": hook}
