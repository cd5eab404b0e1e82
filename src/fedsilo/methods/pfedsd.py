"""pFedSD (Jin et al. 2023, TPDS): personalized models by self-distillation from the client's previous model."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedsilo.client.local import make_generator, train_local
from fedsilo.methods.base import MethodParams, Spares
from fedsilo.methods.personal import PersonalModels
from fedsilo.methods.terms import distillation_kl
from fedsilo.models import LayeredNet


class PFedSDParams(MethodParams):
    lam: float = Field(1.0, ge=0, description="lambda: weight of the self-distillation term")
    tau: float = Field(1.0, gt=0, description="softmax temperature of the distillation")
    teacher_bn: Literal["running", "batch"] = Field(
        "running", description="BatchNorm of the teacher: running = its running statistics (evaluation mode); batch = "
        "the batch's statistics, as the authors' code runs its deep-copied teacher (never put in eval mode)",
    )


class PFedSD(PersonalModels):
    """pFedSD (Jin et al. 2023, TPDS, "Personalized Edge Intelligence via Federated Self-Knowledge Distillation").

    FedAvg on the server. A sampled client starts from the downloaded global model and trains it on
    CE(y, f(x)) + lambda * tau^2 * KL(softmax(f_prev(x)/tau) || softmax(f(x)/tau)), where f_prev is the client's own
    personalized model from its previous participation (the model its last local training produced). The trained
    model becomes the client's new personalized model, is uploaded whole and averaged. A client's first
    participation has no teacher and trains with the cross-entropy alone. Clients are evaluated with their
    personalized models (a client never sampled yet, with the global model); the global model is reported too.

    Choices: lambda = 1 and tau = 1 are the defaults of the authors' code (github:CGCL-codes/pFedSD, ``--lamda``,
    ``--KL_T``). The teacher is never updated; by default it runs in evaluation mode (its BatchNorm uses its running
    statistics); the authors' code never puts its deep-copied teacher in evaluation mode, so it normalizes with the
    batch's statistics (``teacher_bn: batch``). The server's mean is weighted by sample size like every FedAvg here
    (the authors' code averages uniformly over the sampled clients) and covers the whole state, BatchNorm running
    statistics included; the authors' ``_average_model`` averages ``parameters()`` only, so their global model keeps
    its initial statistics (0 / 1) and a client's start from them each round (not copied: with a few batches a round,
    as on Office-Caltech-10, most of the statistics a client is evaluated with would be those initial values)."""

    name = "pfedsd"
    joinable = True  # one global model and per-client personalized models: a site may join mid-run
    params_cls = PFedSDParams
    params: PFedSDParams

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        self._teacher = Spares(1)  # the teacher, beside each model a client trains

    def init_client(self, model: LayeredNet, client) -> dict:
        return {}  # no personalized model before the client's first local training

    def local_update(self, model, store, payload, client, rnd, seed):
        model.load_state_dict(payload, strict=True)
        batch_loss = None
        if store:
            (teacher,) = self._teacher.of(model)
            teacher.load_state_dict(self.personal(store), strict=True)
            teacher.train(self.params.teacher_bn == "batch")
            lam, tau = self.params.lam, self.params.tau

            def batch_loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
                with torch.no_grad():
                    t = teacher(x)
                return lam * distillation_kl(logits, t, tau)

        self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index), batch_loss=batch_loss)
        sd = model.state_dict()
        self.keep_personal(store, sd)
        return {k: sd[k].detach() for k in self.shared}
