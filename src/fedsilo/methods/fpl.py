"""FPL: federated prototype learning under domain shift (Huang, Ye, Du et al., CVPR 2023, "Rethinking federated
learning with domain shift: a prototype view")."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from pydantic import Field

from fedsilo.client.features import representation
from fedsilo.client.local import batches_per_epoch, make_generator, train_local
from fedsilo.methods.base import MethodParams
from fedsilo.methods.decoupling import DecouplingParams
from fedsilo.methods.prototypes import (
    PrototypeSharing,
    PrototypeSums,
    by_class,
    cluster_prototypes,
    from_payload,
    to_payload,
)

CLUSTERS = "fpl_clusters::"  # the server's cluster prototypes of class c (k_c x d), downloaded with the model


class FPLParams(MethodParams):
    temperature: float = Field(0.02, gt=0, description="InfoNCE temperature of the cluster-prototype contrast (the code's infoNCET)")
    decouple: Optional[DecouplingParams] = Field(None, description="F²DC's DFD and DFC plugged in (F²DC Table 3)")


def fpl_loss(z: torch.Tensor, y: torch.Tensor, clusters: dict[int, torch.Tensor], temperature: float) -> torch.Tensor:
    """Mean over the batch of CPCL + UPCL (Eq. 6 and 8). For a sample of class c with representation z:
    -log( sum_{p in P_c} e^{cos(z,p)/T} / sum_{p in P} e^{cos(z,p)/T} ) over the cluster prototypes (positives: class
    c's clusters; P: every class's), plus the mean squared distance to the unbiased prototype of c (the mean of c's
    cluster prototypes). Samples of a class with no prototype contribute 0 but count in the mean, as in the code. In
    float32 whatever precision the forward ran in (bf16 autocast would round the prototypes and the squared
    distance; the code runs in float32)."""
    classes = sorted(clusters)
    z = z.float()
    bank = torch.cat([clusters[c] for c in classes]).to(z.device, torch.float32)
    owner = torch.cat([torch.full((len(clusters[c]),), c) for c in classes]).to(z.device)
    unbiased = {c: clusters[c].mean(0).to(z.device, torch.float32) for c in classes}
    sim = F.cosine_similarity(z[:, None, :], bank[None, :, :], dim=2) / temperature  # B x P
    pos = owner[None, :] == y[:, None]
    known = pos.any(1)
    log_all = torch.logsumexp(sim, dim=1)
    log_pos = torch.logsumexp(sim.masked_fill(~pos, float("-inf")), dim=1)
    cpcl = torch.where(known, log_all - log_pos, torch.zeros_like(log_all))
    target = torch.stack([unbiased.get(int(c), torch.zeros_like(z[0])) for c in y.tolist()])
    upcl = torch.where(known, ((z - target) ** 2).mean(1), torch.zeros_like(log_all))
    return (cpcl + upcl).sum() / len(y)


class FPL(PrototypeSharing):
    """Huang et al. 2023 (CVPR), as the authors' code runs it (github:WenkeHuang/RethinkFL, ``models/fpl.py``). A
    client downloads the global model and, from round 2, the cluster prototypes of every class; it trains on
    CE + CPCL + UPCL (``fpl_loss``) and, during its last local epoch, accumulates the representation z = r(x) (the
    classifier's input) of each training sample per class; it uploads the model and its class prototypes (their
    means). The server averages the models by sample size and, per class, clusters the participants' prototypes with
    FINCH (cosine, the coarsest partition) into cluster prototypes, which the next round downloads. Clients are
    evaluated with the global model.

    Choices: the prototypes are the features of the training forward in the last epoch (augmented inputs, training
    mode), as the code collects them; FINCH runs without its early-exit threshold and with the stopping rule of the
    copy the code ships (``fedsilo.methods.prototypes.finch``); T = 0.02 is the code's default; UPCL is the code's
    ``nn.MSELoss``, the mean over the feature dimension (the paper writes a squared distance summed over it: d times
    the pull, 512 on ResNet-10)."""

    name = "fpl"
    joinable = True  # a global model and per-class prototypes, none per client: a site may join mid-run
    params_cls = FPLParams
    params: FPLParams

    def local_update(self, model, store, payload, client, rnd, seed):
        clusters = from_payload(payload, CLUSTERS)  # none before the first aggregation
        self.load_round(model, store, payload)
        sums = PrototypeSums()
        epochs = self.train.local_epochs
        seen = {"batches": 0}
        n_batches = batches_per_epoch(client.n_train, self.train.batch_size)
        with representation(model) as rep:

            def batch_loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
                seen["batches"] += 1
                if seen["batches"] > (epochs - 1) * n_batches:  # the last local epoch: collect the prototypes
                    sums.add(rep.z, y)
                if not clusters:
                    return torch.zeros((), device=y.device)
                return fpl_loss(rep.z, y, clusters, self.params.temperature)

            terms = self.with_decoupling(model, {"batch_loss": batch_loss}, client, rnd, seed)
            self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index), **terms)
        return {**self.keep_and_share(model, store), **to_payload(sums.means())}

    def server_prototypes(self, server, pairs, rnd):
        """Each class's cluster prototypes: FINCH over the round's prototypes of that class."""
        return {f"{CLUSTERS}{cls}": cluster_prototypes(ps) for cls, ps in sorted(by_class(pairs).items())}
