"""Ditto (Li et al. 2021, ICML): a global model by FedAvg and a personal model per client pulled towards it."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from fedsilo.client.local import make_generator, train_local
from fedsilo.methods.base import MethodParams, State
from fedsilo.methods.personal import PersonalModels
from fedsilo.methods.terms import proximal_term
from fedsilo.models import LayeredNet


class DittoParams(MethodParams):
    lam: float = Field(0.1, ge=0, description="lambda: pull of the personal model towards the global one")
    personal_epochs: Optional[int] = Field(None, ge=1, description="local epochs on the personal model (default: train.local_epochs)")


class Ditto(PersonalModels):
    """Li et al. 2021 (ICML), Algorithm 1: each sampled client (i) updates the global model w from the download
    w^t with E local epochs of SGD and uploads it (FedAvg aggregation), and (ii) updates its personal model v_k, which
    never leaves the client, by SGD on F_k(v) + (lambda/2)||v - w^t||^2, anchored at the downloaded w^t. Clients are
    evaluated with their personal models; the global model is reported as well. The personal model's BatchNorm
    statistics are its own."""

    name = "ditto"
    joinable = True  # one global (or shared) state and per-client stores only: a site may join mid-run
    params_cls = DittoParams
    params: DittoParams

    def init_client(self, model: LayeredNet, client) -> dict:
        store: State = {}
        self.keep_personal(store, model.state_dict())
        return store

    def local_update(self, model, store, payload, client, rnd, seed):
        # (ii) personal model, anchored at the downloaded global model
        model.load_state_dict(self.personal(store), strict=True)
        train_local(
            model, client, self.train, make_generator(seed, rnd, client.index, 1),
            epochs=self.params.personal_epochs, extra_loss=proximal_term(model, payload, self.params.lam),
        )
        self.keep_personal(store, model.state_dict())
        # (i) the global model's local update, uploaded
        model.load_state_dict(payload, strict=True)
        self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index, 0))
        return {k: v.detach() for k, v in model.state_dict().items()}
