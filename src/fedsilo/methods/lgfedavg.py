"""LG-FedAvg: local representations, global top layers (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov and
Morency, 2020, "Think locally, act globally: federated learning with local and global representations")."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field, PositiveInt

from fedsilo.client.data import ClientData
from fedsilo.methods.base import (
    ClientWeights,
    MethodParams,
    State,
    TakenMean,
    check_rounds_fit,
    client_weights_field,
    per_backbone_type,
)
from fedsilo.methods.sharing import PartialSharing, head_and_body_keys, per_backbone, top_units
from fedsilo.models import LayeredNet

# the server's record that a site has received the FedAvg start's local layers: + the site's name, made when it takes them
STARTED = "lgfedavg:started::"


class LGFedAvgParams(MethodParams):
    global_layers: per_backbone_type(PositiveInt) = Field(
        2, description="weighted layers at the top shared by every client (the code's num_layers_keep); a mapping "
        "backbone -> count for one methods block serving several backbones (a ResNet's unit holds two layers: "
        "{lenet5: 2, resnet34: 1} shares LeNet's two top FC layers and a ResNet's classifier)",
    )
    fedavg_rounds: int = Field(
        0, ge=0, description="rounds of plain FedAvg (every layer shared) before the lower layers become each client's "
        "own: the paper's FedAvg-trained start, counted in train.rounds (0: start from the initialisation, as FedPAC's code)"
    )
    client_weights: ClientWeights = client_weights_field("samples", "samples is FedPAC's code, whose LG-FedAvg "
                                                         "FedeCouple runs; uniform the LG-FedAvg code's mean")


class LGFedAvg(PartialSharing):
    """Liang et al. 2020, Algorithm 1. Each client keeps its own lower layers (the local representation l_m, never
    uploaded) and shares the top ``global_layers`` weighted layers g: a sampled client downloads g^t, trains its whole
    model (its local layers and g) jointly on cross-entropy for E epochs, and uploads g; the server averages the
    uploaded g and every client receives it. Clients are evaluated with their own lower layers plus the global top.

    **The FedAvg-trained start** (``fedavg_rounds: R0``). The paper's experiments, and its code's recipe (the
    repository's README: ``main_fed.py`` first, then ``main_lg.py --load_fed best_<N>.pt``), start LG-FedAvg from a
    model trained by FedAvg: every client's local model is a copy of that global model. Here rounds 1..R0 are FedAvg:
    a sampled client downloads every layer, trains, and uploads every layer (the check of uploads lets the lower layers
    through in those rounds only, :meth:`private_in_round`); the server's weighted mean of whole models is the global
    model, and every client is evaluated with it. From round R0+1 on the lower layers are private: a client's first
    download after R0 carries, besides g, the lower layers of the FedAvg model of round R0, which become its own (the
    server sends them once, when the client is first sampled, and records that it did; a client not yet sampled is
    evaluated with them under the current g, as the code evaluates every client's copy; a site that joins a run in
    progress after R0, ``joinable``, takes them as such a client). The bytes of that one download are counted like
    any other. R0 is inside ``train.rounds`` (R0 FedAvg rounds, then ``rounds - R0``
    LG-FedAvg rounds). The code loads ``best_<N>.pt``, the FedAvg model with the best *test* accuracy among the first
    N rounds; here the model of round R0 is taken (no selection on the test set). The README's CIFAR-10 recipe is
    1,200 FedAvg rounds, then 200 LG-FedAvg rounds; MNIST 400, then 200. ``fedavg_rounds: 0`` (the default) starts
    from the run's initialisation, as FedPAC's code runs its LG-FedAvg baseline (the protocol FedeCouple follows).

    The paper's split is followed (local bottom, global top; ``global_layers`` of them: the code's default
    ``num_layers_keep`` is 1, its CIFAR-10 script passes 2); on its CIFAR CNN that count of 2 instead keeps the two
    *convolutions* global (an open issue in its repository), which is FedPer's direction, available
    here as ``fedper``. Aggregation is the sample-size-weighted mean, as FedPAC's code (whose protocol FedeCouple
    follows) aggregates it; the LG-FedAvg code averages uniformly over the sampled clients (the same with equal client
    sizes, as in its experiments): ``client_weights: uniform``. The code's choice of each client's best model
    by test accuracy during the LG-FedAvg rounds is not copied (it selects on the test set)."""

    name = "lgfedavg"
    params_cls = LGFedAvgParams
    params: LGFedAvgParams
    joinable = True  # the record of the FedAvg start is made per site as it takes it: a site may join mid-run

    def shared_keys(self, model: LayeredNet) -> list[str]:
        what = f"methods.{self.key}.global_layers"
        k = top_units(model, per_backbone(self.params.global_layers, self.train.model, what), what)
        self.local_units = model.unit_names[:k]
        return head_and_body_keys(model, k)[0]  # the top layers

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        check_rounds_fit(self, self.key, self.train.rounds, "train.rounds")

    def fedavg_round(self, rnd: int) -> bool:
        return rnd <= self.params.fedavg_rounds

    def private_in_round(self, rnd: int, private: set[str]) -> set[str]:
        return set() if self.fedavg_round(rnd) else private

    # --- server
    def init_server(self, model: LayeredNet) -> State:
        if not self.params.fedavg_rounds:
            return super().init_server(model)
        sd = model.state_dict()  # the whole model: FedAvg's global model until R0, its lower layers kept as the start
        return {k: v.detach().clone() for k, v in sd.items()}

    def newcomer_refusal(self) -> str:
        if not self.params.fedavg_rounds:
            return ""
        return ("with fedavg_rounds a site's lower layers are its own once the server recorded that it took the FedAvg "
                "start (its first upload), which a finished federation takes none of from a newcomer: every round would "
                "give it the start again")

    def takes_start(self, server: State, client: ClientData) -> bool:
        """Whether the client is to take the FedAvg start's lower layers from ``server``: they are there (the whole
        server state holds them; what a site is sent for evaluation, :meth:`eval_download`, only if it must) and the
        server has no record of the site taking them."""
        return STARTED + client.name not in server and any(k in server for k in self.private)

    def sent(self, server: State, client: ClientData, whole: bool) -> State:
        """The global top, with the lower layers when ``whole`` (a FedAvg round) or when the client has not taken the
        FedAvg start's yet."""
        keys = [*self.shared, *(self.private if whole or self.takes_start(server, client) else [])]
        return {k: server[k] for k in keys}

    def download(self, server: State, client: ClientData, rnd: int) -> State:
        if not self.params.fedavg_rounds:
            return super().download(server, client, rnd)
        return self.sent(server, client, self.fedavg_round(rnd))

    def agg_begin(self, server: State, rnd: int) -> TakenMean:
        return TakenMean()

    def agg_add(self, acc: TakenMean, client: ClientData, upload: State) -> None:
        super().agg_add(acc, client, upload)
        acc.took.append(client.name)

    def agg_end(self, server: State, acc: TakenMean, rnd: int) -> State:
        if not self.params.fedavg_rounds:
            return super().agg_end(server, acc, rnd)
        out = {**server, **acc.result()} if acc.weight > 0 else dict(server)
        if not self.fedavg_round(rnd):  # these clients now hold their own lower layers
            out.update({STARTED + name: torch.tensor(1, dtype=torch.uint8) for name in acc.took})
        return out

    # --- client
    def local_update(self, model, store, payload, client, rnd, seed):
        up = super().local_update(model, store, payload, client, rnd, seed)
        if self.fedavg_round(rnd):  # FedAvg: the lower layers travel too
            sd = model.state_dict()
            up = {k: sd[k].detach() for k in (*self.shared, *self.private)}
        return up

    def eval_state(self, server, store, client):
        start = {k: server[k] for k in self.private} if self.takes_start(server, client) else {}
        return {**store, **start, **{k: server[k] for k in self.shared}}

    def eval_download(self, server: State, client: ClientData) -> State:
        """The global top, with the FedAvg start's lower layers for a client that has not taken them yet."""
        return self.sent(server, client, whole=False) if self.params.fedavg_rounds else server

    def resolved(self) -> dict[str, Any]:
        return {**super().resolved(), "local_layers": getattr(self, "local_units", [])}
