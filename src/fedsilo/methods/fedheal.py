"""FedHEAL: fair federated learning under domain skew (Chen, Huang, Ye et al., CVPR 2024)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from pydantic import Field

from fedsilo.methods.base import MethodParams, State
from fedsilo.methods.decoupling import DecouplingParams
from fedsilo.methods.sharing import PartialSharing
from fedsilo.models import LayeredNet

SERVER = "heal::"  # the server's own bookkeeping, never downloaded


class FedHEALParams(MethodParams):
    threshold: float = Field(0.3, ge=0, le=1, description="tau: an element is kept when its update's sign has held in more than this share of the client's past rounds")
    beta: float = Field(0.4, ge=0, le=1, description="momentum of the fair-aggregation weight increments")
    decouple: Optional[DecouplingParams] = Field(None, description="F²DC's DFD and DFC plugged in (F²DC Table 3)")


class FedHEAL(PartialSharing):
    """Chen et al. 2024 (CVPR), as the authors' code runs it (github:yuhangchen0/FedHEAL, ``fedavgheal``): clients
    train the downloaded global model with plain cross-entropy and upload it whole, as in FedAvg. The server

    1. forms each participant's update Delta_k = w - w_k and its *parameter update consistency* mask: element-wise,
       the share of the client's past rounds whose update had the same sign must exceed tau (all ones at the
       client's first round; the share is a running mean kept per client);
    2. measures the masked update's size dist_k = sum over parameter tensors of ||m_k * Delta_k||_2 and moves the
       client's fair-aggregation weight by a momentum step, dw_k <- (1 - beta) dw_k + beta dist_k / sum_j dist_j,
       w_k <- w_k + dw_k (starting from 1 / K, K the sites the federation holds in the round the client first
       uploads, ``Method.round_members``: those that have joined by then; the code starts from 1 / the clients
       online in the round, the same under full participation; the un-normalized weight persists, the normalized
       one aggregates);
    3. aggregates element-wise: w <- w - sum_k [a_k m_k / sum_j a_j m_j] (m_k * Delta_k); an element every client
       masked out keeps its value (the code's fallback weights a_k multiply masked, hence zero, updates).

    The masks and weights live on the server (the code computes them there), so the upload is FedAvg's, as the
    paper's Table 4 counts it. Choices: the consistency share counts the client's own participations (the code
    counts global rounds, which is the same under its full participation, and fails for a client first sampled
    late); the distance normalizer sums the round's participants. Clients are evaluated with the global model.
    A site may join a run in progress (``joinable``): its history, mask and weight start at its first upload as
    every site's did, from 1 / K of the federation it joined."""

    name = "fedheal"
    params_cls = FedHEALParams
    params: FedHEALParams
    joinable = True  # per-site bookkeeping made at a site's first upload, K from the round's members: a site may join mid-run

    def shared_keys(self, model: LayeredNet) -> list[str]:
        return list(model.state_dict().keys())

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        # a list in the model's order: the distance sums float norms over it, and a set's order would follow the
        # process's hash seed (two processes of the same run would differ in the last bits)
        shared = set(self.shared)
        self.param_keys = [n for n, _ in model.named_parameters() if n in shared]

    # the server keeps its bookkeeping beside the model; a download is the model only
    def download(self, server: State, client, rnd: int) -> State:
        return {k: server[k] for k in self.shared}

    def eval_download(self, server: State, client) -> State:
        """The model only: the server's bookkeeping (every site's sign history and weight) stays on the server."""
        return self.download(server, client, 0)

    def consistency_mask(self, server: State, name: str, delta: State) -> State:
        """Element-wise mask (bool) of the updates whose sign agrees with the client's history; updates the history."""
        count_key = f"{SERVER}{name}::count"
        t = int(server[count_key]) if count_key in server else 0
        mask: State = {}
        for k, d in delta.items():
            up = (d >= 0).float()
            hist_key = f"{SERVER}{name}::hist::{k}"
            if t == 0:
                mask[k] = torch.ones_like(d, dtype=torch.bool)
                server[hist_key] = up
            else:
                hist = server[hist_key]
                mask[k] = torch.where(d >= 0, hist, 1 - hist) > self.params.threshold
                server[hist_key] = (hist * t + up) / (t + 1)
        server[count_key] = torch.tensor(t + 1)
        return mask

    def fair_weights(self, server: State, dist: dict[str, float]) -> dict[str, float]:
        total = sum(dist.values())
        raw: dict[str, float] = {}
        for name, d in dist.items():
            w_key, dw_key = f"{SERVER}{name}::weight", f"{SERVER}{name}::delta_weight"
            prev_dw = float(server[dw_key]) if dw_key in server else 0.0
            dw = (1 - self.params.beta) * prev_dw + self.params.beta * (d / total if total > 0 else 0.0)
            w = (float(server[w_key]) if w_key in server else 1.0 / max(1, len(self.members))) + dw
            server[w_key], server[dw_key] = torch.tensor(w, dtype=torch.float64), torch.tensor(dw, dtype=torch.float64)
            raw[name] = w
        z = sum(raw.values())
        return {name: w / z for name, w in raw.items()}

    streaming = False

    def aggregate(self, server: State, uploads: list[tuple[Any, State]], rnd: int) -> State:
        """Two passes over the tensors, so that the server holds one float32 update per client only for the tensor it
        is working on (masks are kept as booleans in between)."""
        if not uploads:
            return server
        server = dict(server)
        masks: dict[str, State] = {}
        dist: dict[str, float] = {}
        for c, up in uploads:  # pass 1, one client's update at a time: masks, histories, distances
            delta = {k: server[k].float() - up[k].float() for k in self.shared}
            masks[c.name] = self.consistency_mask(server, c.name, delta)
            dist[c.name] = float(sum(torch.linalg.vector_norm(delta[k] * masks[c.name][k]) for k in self.param_keys))
            del delta
        a = self.fair_weights(server, dist)
        names = [c.name for c, _ in uploads]
        by_name = {c.name: up for c, up in uploads}
        for k in self.shared:  # pass 2: element-wise fair aggregation
            m = torch.stack([masks[n][k] for n in names]).float()
            a_k = torch.tensor([a[n] for n in names], dtype=torch.float32, device=m.device).view(-1, *[1] * (m.dim() - 1))
            adjusted = a_k * m
            total = adjusted.sum(0, keepdim=True)
            weights = torch.where(total == 0, a_k.expand_as(adjusted), adjusted / torch.where(total == 0, torch.ones_like(total), total))
            step = sum(weights[i] * (server[k].float() - by_name[n][k].float()) * m[i] for i, n in enumerate(names))
            new = server[k].float() - step
            server[k] = new.round().to(server[k].dtype) if not server[k].is_floating_point() else new.to(server[k].dtype)
        return server

