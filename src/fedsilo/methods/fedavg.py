"""FedAvg (McMahan et al. 2017), optionally under the two-phase protocol of pFedDB's Fig. 5."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from fedsilo.client.local import make_generator, train_local
from fedsilo.config import ConfigError
from fedsilo.methods import decoupling
from fedsilo.methods.base import MethodParams
from fedsilo.methods.decoupling import DecouplingParams
from fedsilo.methods.phased import TwoPhase
from fedsilo.models import LayeredNet


class FedAvgParams(MethodParams):
    local_rounds: int = Field(
        0, ge=0, description="Phase-1 rounds of purely local training before federating (0 = plain FedAvg)"
    )
    decouple: Optional[DecouplingParams] = Field(None, description="F²DC's DFD and DFC plugged in (F²DC Table 3)")
    finetune_epochs: int = Field(0, ge=0, description="FT-FedAvg: epochs each client fine-tunes the global model on its own training data before it is evaluated (0 = FedAvg)")
    finetune_lr: Optional[float] = Field(None, gt=0, description="FT-FedAvg's fine-tuning learning rate (default train.lr)")


class FedAvg(TwoPhase):
    """McMahan et al. 2017: a sampled client downloads the global model, runs E local epochs of SGD and uploads the
    whole state_dict (parameters and BatchNorm statistics); the server takes the sample-size-weighted mean. Every
    client is evaluated with the global model.

    ``local_rounds: E0 > 0`` is "FedAvg under the two-phase protocol" of pFedDB's Fig. 5: in rounds 1..E0 every
    client trains its own copy (from the shared initialisation) and nothing is sent; in round E0 every client uploads
    its model, and the server's mean starts ordinary FedAvg from round E0 + 1 (the start pFedDB's Eq. 6 gives its
    shared branch). In Phase 1 each client is evaluated with its own model.

    ``finetune_epochs: E_ft > 0`` is FT-FedAvg, the baseline of FedPAC's and FedeCouple's tables: training is FedAvg's,
    and to be evaluated each client fine-tunes the global model on its own training data for E_ft epochs (``train``'s
    optimizer, ``finetune_lr``), seeded by (seed, round, client); the fine-tuned model is thrown away, so evaluating
    changes no later number. The global model is reported beside it. With F²DC's modules plugged in (``decouple``)
    the fine-tuning's mask noise is seeded by (seed, round, client) too, so a client's evaluation never depends on
    which client trained last."""

    name = "fedavg"
    joinable = True  # one global (or shared) state and per-client stores only: a site may join mid-run
    params_cls = FedAvgParams
    task_stream = True  # on a domain_incremental split: fine-tuned task after task (pFedDIL's FedAvg baseline)

    def check_stream(self) -> None:
        for key in ("local_rounds", "finetune_epochs"):
            if getattr(self.params, key, 0):
                raise ConfigError(f"methods.{self.key}.{key}: not defined on a stream of domain tasks (it would train on "
                                  "earlier tasks' images); set it to 0 for a domain_incremental split")

    def shared_keys(self, model: LayeredNet) -> list[str]:
        return list(model.state_dict().keys())

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        if self.e0 and self.decoupling() is not None:
            raise ConfigError(f"methods.{self.key}: decouple (F²DC's modules) runs with the one-phase FedAvg only; set local_rounds: 0")
        # Phase 1's starting point; kept here, not in init_server, so that a resumed run (which skips init_server)
        # has it too: setup always sees the seeded initialisation
        self._init = {k: v.detach().clone() for k, v in model.state_dict().items()} if self.e0 else {}

    # Phase 1: the client's own full model lives in its store
    def local_phase_update(self, model, store, client, gen):
        own = self.model_state(store)  # a subclass's bookkeeping in the store stays out of the model
        model.load_state_dict(own if own else self._init, strict=True)
        loss = train_local(model, client, self.train, gen)
        store.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return loss

    def phase_one_upload(self, model, store):
        for k in [k for k in store if k in self.model_keys]:  # federation starts: the client keeps no model of its own
            del store[k]
        sd = model.state_dict()
        return {k: sd[k].detach() for k in self.shared}

    # evaluation: the client's own model before the federation, the global model after (with the client's private
    # tensors, F²DC's modules, where there are any)
    def eval_state(self, server, store, client):
        return self.model_state(server, store) if not self.federated() else self.model_state(store, server)

    def load_eval_model(self, model, server, store, client, rnd):
        super().load_eval_model(model, server, store, client, rnd)
        epochs = getattr(self.params, "finetune_epochs", 0)
        if epochs and self.federated():  # FT-FedAvg: the client's own fine-tuning of the global model
            tune = self.train.model_copy(update={"lr": self.params.finetune_lr or self.train.lr})
            if self.decoupling() is not None:  # F²DC's masks in training mode draw noise: seeded by (seed, round, client)
                decoupling.seed_noise(model, int(make_generator(self.run_seed, rnd, client.index, 11).initial_seed()), client.x_train.device)
            train_local(model, client, tune, make_generator(self.run_seed, rnd, client.index, 2), epochs=epochs)

    def global_state(self, server):
        return super().global_state(server) if self.federated() else None

    def eval_is_global(self) -> bool:
        return self.federated() and super().eval_is_global() and not getattr(self.params, "finetune_epochs", 0)
