"""FedSA: a unified representation learning via semantic anchors for prototype-based federated learning (Y. Zhou,
X. Qu, C. You et al., AAAI 2025; F²DC's reference [57]; code github:lokinko/FedSA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsilo.client.features import classifier, representation
from fedsilo.client.local import make_generator, train_local
from fedsilo.methods.base import MethodParams, State
from fedsilo.methods.fedtgp import margin_contrastive_loss
from fedsilo.methods.prototypes import PrototypeSharing, PrototypeSums, by_class, from_payload, to_payload
from fedsilo.models import LayeredNet

ANCHORS = "sa_anchors"  # C x d, on the server and in every download
PREVIOUS = "sa_prev::"  # the client's prototypes of its previous participation (for its local gap), kept home


class FedSAParams(MethodParams):
    lam: float = Field(10.0, ge=0, description="weight of the anchor regularizer MSE(r(x), A_y) (the authors' scripts: 10)")
    mcl: float = Field(1.0, ge=0, description="weight of the margin-enhanced contrastive term")
    cc: float = Field(1.0, ge=0, description="weight of the anchor-based classifier calibration CE(h(A), c)")
    ema: float = Field(0.9999, ge=0, le=1, description="anchor EMA: A_c <- ema A_c + (1 - ema) mean prototype (the code's constant)")


def mean_nearest_gap(centres: torch.Tensor) -> float:
    """mean over classes of the distance to the nearest other class (-inf with one class, as the code)."""
    if len(centres) < 2:
        return float("-inf")
    d = torch.cdist(centres.float(), centres.float())
    d.fill_diagonal_(float("inf"))
    return float(d.min(1).values.mean())


def initial_anchors(num_classes: int, dim: int, seed: int) -> torch.Tensor:
    """Random class centres through an untrained Linear-BN-ReLU-Linear-BN-ReLU projector in training mode (batch
    statistics over the C centres), as FedSA's code draws them (from SAR, Ge et al. 2024)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        proj = nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(), nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU())
        centres = torch.randn(num_classes, dim)
        proj.train()
        with torch.no_grad():
            return proj(centres).detach()


class FedSA(PrototypeSharing):
    """Zhou et al. 2025 (AAAI), with the model shared as we take the F²DC comparison to run it (F²DC's repository ships
    no FedSA). The server holds semantic anchors A (one per class, drawn once, then moved slowly by the EMA below); a client downloads the global model and A and trains on
    CE + cc CE(h(A), c) + lambda MSE(r(x), A_y) + mcl CE(-(||r(x) - A_c|| + m [c = y]), y), with the margin
    m = max(local gap, anchor gap), each the mean over classes of the distance to the nearest other class (the local
    gap from the client's prototypes of its previous participation, 0 at its first). It collects its class
    prototypes from the training forwards of all local epochs, keeps them, and uploads the model and the
    prototypes. The server averages the models by sample size and moves each anchor of a class present in the round
    by A_c <- 0.9999 A_c + 0.0001 mean_k p_k,c (unweighted over clients). Clients are evaluated with the global model.

    FedSA's own code (github:lokinko/FedSA) never aggregates weights and evaluates each client's own model by its
    nearest global prototype; F²DC compares one global model on shared ResNet-10s, so here the weights are FedAvg's
    and the global model's logits are evaluated. Everything else is the code's: lambda = 10, mcl = cc = 1 (its
    scripts), the anchors' construction (seeded by the run's seed instead of a constant 0), the EMA constant, the
    uncapped mean-gap margin, prototypes from training-mode features of all epochs."""

    name = "fedsa"
    joinable = True  # a global model and per-class anchors, none per client: a site may join mid-run
    params_cls = FedSAParams
    params: FedSAParams

    def private_keys(self, model: LayeredNet) -> set[str]:
        return super().private_keys(model) | {f"{PREVIOUS}{c}" for c in range(classifier(model).out_features)}

    def init_server(self, model: LayeredNet) -> State:
        return {**super().init_server(model), ANCHORS: initial_anchors(self.num_classes, self.dim, self.run_seed)}

    def local_update(self, model, store, payload, client, rnd, seed):
        anchors = payload[ANCHORS].to(client.x_train.device)
        self.load_round(model, store, payload)
        previous = from_payload(store, PREVIOUS)
        local_gap = mean_nearest_gap(torch.stack([previous[c] for c in sorted(previous)])) if previous else 0.0
        margin = max(local_gap, mean_nearest_gap(anchors))
        head = classifier(model)
        every = torch.arange(self.num_classes, device=anchors.device)
        p = self.params
        sums = PrototypeSums()
        with representation(model) as rep:

            def batch_loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
                z = rep.z
                sums.add(z, y)
                a = anchors.float()  # the targets in float32 (under bf16 autocast z is bf16; the anchors are not rounded)
                return (p.cc * F.cross_entropy(head(a), every) + p.lam * F.mse_loss(z.float(), a[y])
                        + p.mcl * margin_contrastive_loss(z, y, a, margin))

            self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index), batch_loss=batch_loss)
        protos = sums.means()
        upload = self.keep_and_share(model, store)
        for k in [k for k in store if k.startswith(PREVIOUS)]:
            del store[k]
        store.update(to_payload(protos, PREVIOUS))
        return {**upload, **to_payload(protos)}

    def server_prototypes(self, server, pairs, rnd):
        """Each anchor of a class present in the round moved towards the mean of its uploaded prototypes (EMA)."""
        anchors = server[ANCHORS].clone()
        for cls, ps in by_class(pairs).items():
            mean_c = torch.stack([v.float() for v in ps]).mean(0).to(anchors.device)
            anchors[cls] = self.params.ema * anchors[cls] + (1 - self.params.ema) * mean_c
        return {ANCHORS: anchors}
