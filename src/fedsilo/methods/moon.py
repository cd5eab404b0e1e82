"""MOON: model-contrastive federated learning (Li, He, Song, CVPR 2021)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedsilo.client.features import features, representation
from fedsilo.client.local import make_generator, train_local
from fedsilo.methods.base import MethodParams, Spares, State, fresh_copy
from fedsilo.methods.sharing import PartialSharing
from fedsilo.models import LayeredNet

PREVIOUS = "moon_prev::"


class MOONParams(MethodParams):
    mu: float = Field(5.0, ge=0, description="weight of the model-contrastive loss (F²DC's runs: 5)")
    temperature: float = Field(0.5, gt=0, description="temperature of the contrastive softmax (F²DC's runs: 0.5)")
    reference_bn: Literal["running", "batch"] = Field(
        "running", description="BatchNorm of the global and previous models when they give z_glob and z_prev: running = "
        "their running statistics (MOON's code); batch = the batch's statistics (F²DC's runs: never put in eval mode)",
    )
    first_previous: Literal["initial", "own_init"] = Field(
        "initial", description="a client's previous model before it has trained: initial = the federation's initial "
        "model (no contrast in round 1, where the global model is that model; a client first sampled later, or a site "
        "that joins mid-run, contrasts against it in its first round); own_init = a model of its own drawn from PyTorch's default "
        "initialization (F²DC's code: each client's previous net is its own independently initialized net)",
    )


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, temperature: float) -> torch.Tensor:
    """-log( exp(sim(z, z_glob)/T) / (exp(sim(z, z_glob)/T) + exp(sim(z, z_prev)/T)) ), batch mean (MOON Eq. 3)."""
    pos = F.cosine_similarity(z, z_glob, dim=1) / temperature
    neg = F.cosine_similarity(z, z_prev, dim=1) / temperature
    logits = torch.stack([pos, neg], dim=1).float()
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


class MOON(PartialSharing):
    """Li et al. 2021 (CVPR), Algorithm 1. A sampled client downloads the global model w^t and trains it on
    CE + mu * l_con, where l_con contrasts the representation z = r(x) of the model being trained with that of the
    global model (positive) and of the client's own model from its previous round (negative, Eq. 3); it uploads the
    whole model (FedAvg's weighted mean) and keeps the trained model as its next "previous" model, which never
    leaves the client. Clients are evaluated with the global model.

    Choices: z is the input of the classifier (the pooled 512-d feature of ResNet-10), without the projection head
    MOON's own experiments add, as the F²DC authors' MOON runs it (their ``models/moon.py``); mu = 5 and T = 0.5 are
    their settings. The global and previous models are fixed references (no gradient). Two details differ between
    MOON's code and F²DC's, and each is a parameter: (1) ``reference_bn``: MOON's code evaluates the references in
    eval mode (BatchNorm with running statistics: ``running``, the default); F²DC's never puts them in eval mode, so
    their features use the batch's statistics (``batch``, set in the F²DC presets). (2) ``first_previous``: before
    a client has trained, ``initial`` takes the federation's initial model as its previous model, equal to the
    global model in round 1, so the contrast has no gradient then (MOON's code has no negative in its first round);
    F²DC's code starts each client's previous net from its own independent initialization (``own_init``, drawn
    here from PyTorch's default initialization with a per-(seed, client) seed; set in the F²DC presets). F²DC's
    code also runs two training forwards a step (the features, then the logits), updating BatchNorm's running
    statistics twice; the gradient is the same as one forward's, which is what runs here."""

    name = "moon"
    joinable = True  # one global model and per-client previous models: a site may join mid-run
    params_cls = MOONParams
    params: MOONParams

    def shared_keys(self, model: LayeredNet) -> list[str]:
        return list(model.state_dict().keys())

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        self.keys = list(model.state_dict().keys())
        self._init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._refs = Spares(2)  # the global and the previous model, beside each model a client trains

    def private_keys(self, model: LayeredNet) -> set[str]:
        return {PREVIOUS + k for k in model.state_dict()}

    def init_client(self, model: LayeredNet, client) -> State:
        if self.params.first_previous == "initial":
            return {}  # no previous model until the client has trained once: the initial model stands in
        # own_init: the client's own random net, drawn once here (on the engine's thread, from the initial model the
        # engine holds now, seeded by (run seed, client)), so that clients trained at once draw what one at a time do
        twin = fresh_copy(model, 1_000_003 * (self.run_seed + 1) + client.index)
        return {PREVIOUS + k: v.detach().clone() for k, v in twin.state_dict().items()}

    def local_update(self, model, store, payload, client, rnd, seed):
        glob, prev = self._refs.of(model)
        glob.load_state_dict(payload, strict=True)
        prev.load_state_dict({k: store[PREVIOUS + k] for k in self.keys} if store else self._init, strict=True)
        batch_stats = self.params.reference_bn == "batch"
        glob.train(batch_stats)
        prev.train(batch_stats)
        model.load_state_dict(payload, strict=True)
        mu, t = self.params.mu, self.params.temperature
        with representation(model) as rep:

            def batch_loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
                return mu * model_contrastive_loss(rep.z, features(glob, x), features(prev, x), t)

            self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index), batch_loss=batch_loss)
        sd = model.state_dict()
        for k in self.keys:
            store[PREVIOUS + k] = sd[k].detach().clone()
        return {k: sd[k].detach() for k in self.shared}

    def eval_state(self, server, store, client):
        return dict(server)

    def global_state(self, server):
        return dict(server)

    def eval_is_global(self):
        return True
