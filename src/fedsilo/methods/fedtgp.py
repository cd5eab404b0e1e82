"""FedTGP: trainable global prototypes with adaptive-margin-enhanced contrastive learning (Jianqing Zhang, Yang Liu,
Yang Hua, Jian Cao; AAAI 2024)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsilo.client.features import features_of, representation
from fedsilo.client.local import make_generator, train_local
from fedsilo.methods.base import MethodParams, State
from fedsilo.methods.prototypes import PrototypeSharing, class_means, from_payload, to_payload
from fedsilo.models import LayeredNet

NET = "tgp_net::"  # the server's prototype generator, kept on the server
GLOBAL = "tgp_proto::"  # the generated global prototypes, downloaded


class FedTGPParams(MethodParams):
    lam: float = Field(10.0, ge=0, description="weight of the prototype regularizer (the authors' scripts: 10)")
    margin_threshold: float = Field(100.0, gt=0, description="tau: cap of the adaptive margin")
    server_epochs: int = Field(100, ge=1, description="epochs the server trains its prototype generator per round (scripts: 100)")
    server_lr: Optional[float] = Field(None, gt=0, description="the generator's SGD learning rate (default: train.lr, as the code)")
    server_batch_size: Optional[int] = Field(None, ge=1, description="batch of uploaded prototypes (default: train.batch_size, as the code)")


class PrototypeGenerator(nn.Module):
    """FedTGP's trainable global prototypes: Embedding(C, d) -> Linear -> ReLU -> Linear, one prototype per class."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.embedding = nn.Embedding(num_classes, dim)
        self.middle = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, classes: torch.Tensor) -> torch.Tensor:
        return self.middle(self.embedding(classes))


def adaptive_margin(protos: list[tuple[int, torch.Tensor]], threshold: float) -> float:
    """delta = min(max_c min_{c' != c} ||Q_c - Q_c'||, tau), Q_c the unweighted mean of the round's class-c prototypes
    (one class only: tau)."""
    by_class: dict[int, list[torch.Tensor]] = {}
    for c, p in protos:
        by_class.setdefault(c, []).append(p.float())
    if len(by_class) < 2:
        return float(threshold)
    q = torch.stack([torch.stack(v).mean(0) for _, v in sorted(by_class.items())])
    d = torch.cdist(q, q)
    d.fill_diagonal_(float("inf"))
    return float(min(d.min(1).values.max().item(), threshold))


def margin_contrastive_loss(z: torch.Tensor, y: torch.Tensor, centres: torch.Tensor, margin: float) -> torch.Tensor:
    """CE(-(||z - P_c||_2 + margin * [c = y]), y): the true class's distance is enlarged by the margin."""
    d = torch.cdist(z.float(), centres.float())
    return F.cross_entropy(-(d + margin * F.one_hot(y, centres.shape[0]).float()), y)


def prototype_mse(z: torch.Tensor, y: torch.Tensor, protos: dict[int, torch.Tensor]) -> torch.Tensor:
    """nn.MSELoss(z, target) with target = P_y (detached) for a sample whose class has a prototype, else z itself:
    the mean over batch x d that FedProto's and FedTGP's code compute, in float32 (under bf16 autocast a bf16 target
    would round the prototypes)."""
    target = z.detach().float().clone()
    for c, p in protos.items():
        target[y == c] = p.to(target.device, torch.float32)
    return F.mse_loss(z.float(), target)


class FedTGP(PrototypeSharing):
    """Zhang et al. 2024 (AAAI), with the model shared as we take the F²DC comparison to run it (F²DC's repository
    ships no FedTGP: an assumption from its setting, one global ResNet-10 evaluated per domain). A client downloads the global
    model and the global prototypes P (from round 2), trains on CE + lambda * MSE(r(x), P_y), then computes its
    class prototypes (mean representation per class) over its training data in evaluation mode, and uploads the
    model and the prototypes. The server averages the models by sample size and trains its prototype generator
    (kept on the server across rounds) for ``server_epochs`` on the uploaded (prototype, class) pairs with the
    adaptive-margin contrastive loss CE(-(||p - P_c|| + delta [c = y]), y), delta = min(max_c min_c' ||Q_c -
    Q_c'||, tau); its outputs for every class are the next round's P. Clients are evaluated with the global model.

    FedTGP's own code (github:TsingZ0/FedTGP) targets heterogeneous models: it never aggregates weights and
    evaluates each client's own model by its nearest global prototype. F²DC compares one global model on shared
    ResNet-10s (its tables report the global model per domain), so here the weights are FedAvg's and the global model's logits are evaluated; the client loss, the
    prototypes and the server's generator are the code's (lambda = 10, tau = 100 and 100 server epochs from its
    scripts; the generator's SGD uses the clients' learning rate and batch size, as the code does; the generator is
    initialised from the run's seed). The code's prototype pass drops the last incomplete batch; ours uses every
    training sample."""

    name = "fedtgp"
    joinable = True  # a global model and per-class prototypes, none per client: a site may join mid-run
    params_cls = FedTGPParams
    params: FedTGPParams

    def generator(self) -> PrototypeGenerator:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.run_seed)
            return PrototypeGenerator(self.num_classes, self.dim)

    def init_server(self, model: LayeredNet) -> State:
        gen = self.generator()
        return {**super().init_server(model), **{NET + k: v.detach().clone() for k, v in gen.state_dict().items()}}

    def download(self, server: State, client, rnd: int) -> State:
        return {k: v for k, v in server.items() if not k.startswith(NET)}

    def local_update(self, model, store, payload, client, rnd, seed):
        glob = {c: p.to(client.x_train.device) for c, p in from_payload(payload, GLOBAL).items()}
        self.load_round(model, store, payload)
        lam = self.params.lam
        with representation(model) as rep:

            def batch_loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
                return lam * prototype_mse(rep.z, y, glob) if glob else torch.zeros((), device=y.device)

            self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index), batch_loss=batch_loss)
        protos = class_means(features_of(model, client.x_train, self.train.normalize), client.y_train, chunk=256)
        return {**self.keep_and_share(model, store), **to_payload(protos)}

    def server_prototypes(self, server: State, pairs: list[tuple[int, torch.Tensor]], rnd: int) -> State:
        """The generator trained on the round's prototypes (margin contrast), and its outputs: the global prototypes."""
        gen = self.generator()
        gen.load_state_dict({k[len(NET):]: v for k, v in server.items() if k.startswith(NET)})
        delta = adaptive_margin(pairs, self.params.margin_threshold)
        protos = torch.stack([p.float().cpu() for _, p in pairs])
        labels = torch.tensor([c for c, _ in pairs])
        opt = torch.optim.SGD(gen.parameters(), lr=self.params.server_lr or self.train.lr)
        bs = self.params.server_batch_size or self.train.batch_size
        order_gen = make_generator(self.run_seed, rnd, 4_000_037)
        every = torch.arange(self.num_classes)
        gen.train()
        for _ in range(self.params.server_epochs):
            for idx in torch.randperm(len(labels), generator=order_gen).split(bs):
                opt.zero_grad(set_to_none=True)
                margin_contrastive_loss(protos[idx], labels[idx], gen(every), delta).backward()
                opt.step()
        gen.eval()
        with torch.no_grad():
            out = gen(every)
        return {**{NET + k: v.detach().clone() for k, v in gen.state_dict().items()},
                **{f"{GLOBAL}{c}": out[c].clone() for c in range(self.num_classes)}}

    def resolved(self) -> dict[str, Any]:
        return {**super().resolved(), "prototype_dim": getattr(self, "dim", None)}
