"""Terms methods add to the local objective: a proximal pull towards an anchor model, distillation towards a teacher."""

from __future__ import annotations

import torch
from torch import nn

from fedsilo.client.local import ExtraLoss
from fedsilo.methods.base import State


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float = 1.0, tau2: bool = True) -> torch.Tensor:
    """KL(softmax(teacher / tau) || softmax(student / tau)), averaged over the batch, times tau^2 where ``tau2``
    (Hinton et al. 2015: it keeps the gradients' scale across temperatures)."""
    log_s = torch.log_softmax(student_logits.float() / tau, dim=1)
    log_t = torch.log_softmax(teacher_logits.float() / tau, dim=1)
    kl = torch.nn.functional.kl_div(log_s, log_t, reduction="batchmean", log_target=True)
    return (tau * tau) * kl if tau2 else kl


def proximal_term(model: nn.Module, anchor: State, mu: float) -> ExtraLoss:
    names = [n for n, p in model.named_parameters() if p.requires_grad and n in anchor]
    ref = {n: anchor[n].detach().clone() for n in names}

    def loss(m: nn.Module) -> torch.Tensor:
        params = dict(m.named_parameters())
        return (mu / 2.0) * sum(((params[n] - ref[n]) ** 2).sum() for n in names)  # type: ignore[return-value]

    return loss
