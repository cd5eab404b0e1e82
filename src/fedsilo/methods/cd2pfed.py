"""CD2-pFed: cyclic distillation-guided channel decoupling (Shen, Zhou and Yu, CVPR 2022, "CD2-pFed: Cyclic
Distillation-guided Channel Decoupling for Model Personalization in Federated Learning")."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from pydantic import Field
from torch.nn import functional as F

from fedsilo.client.local import make_generator, train_local
from fedsilo.config import ConfigError
from fedsilo.methods.base import Method, MethodParams, RunningMean, State
from fedsilo.methods.channels import PRIVATE, SHARED, ChannelPartition

LAST = "cd2pfed::last_round::"  # server state: + a site's name, the last round it trained in (none before its first)


class CD2PFedParams(MethodParams):
    p: float = Field(0.5, ge=0, le=1, description="the largest personalization ratio: the private share of every layer's channels at the last round (Eq. 3); p = 0 is FedAvg, p = 1 keeps every channel home (the classifier's shared bias still travels)")
    ratio_rounds: Optional[int] = Field(None, ge=1, description="T of Eq. 3, the round at which the ratio reaches p (default: train.rounds)")
    lam: float = Field(1.0, ge=0, description="lambda: weight of the cyclic distillation loss (Eq. 5)")
    beta: float = Field(0.5, ge=0, le=1, description="beta of Eq. 6-7 (the paper's alpha in Sec. 4.2): weight of the new private weights in their temporal average")
    rampup: float = Field(0.1, ge=0, le=1, description="t0 / T: the share of the rounds over which beta ramps up (Eq. 7; T as in Eq. 3)")
    progressive: bool = Field(True, description="LI: the private ratio grows linearly to p (off: p from the first round)")
    temporal_averaging: bool = Field(True, description="TA: temporal average of the private weights after every local epoch")
    cyclic_distillation: bool = Field(True, description="CD: symmetric KL between the private and the shared subnet")


def cyclic_distillation(logits_private: torch.Tensor, logits_shared: torch.Tensor) -> torch.Tensor:
    """Eq. 4: 1/2 (KL(y_L || y_G) + KL(y_G || y_L)) of the two subnets' softmax predictions, averaged over the
    batch; gradients reach both subnets (they distil each other)."""
    lp, lg = F.log_softmax(logits_private.float(), 1), F.log_softmax(logits_shared.float(), 1)
    kl_pg = F.kl_div(lg, lp, log_target=True, reduction="batchmean")  # KL(y_L || y_G)
    kl_gp = F.kl_div(lp, lg, log_target=True, reduction="batchmean")  # KL(y_G || y_L)
    return 0.5 * (kl_pg + kl_gp)


class CD2PFed(Method):
    """Shen et al. 2022, Algorithm 1. Every layer's output channels are split: a share p_t = p t / T (Eq. 3) of them,
    the lowest indices, is private to the client (w_i), the rest shared (w_0). Per round each client

    1. downloads the shared channels of the previous round's split, w_0^{t-1} (channels that turn private this round
       thus start from the global aggregate, Sec. 3.2),
    2. trains the full network for eta_i epochs (SGD with Nesterov momentum: ``train.nesterov``) on the cross entropy
       of the full network plus lambda times the cyclic distillation between its private subnet g_wi and its shared
       subnet g_w0 (Eq. 4-5),
    3. after every local epoch averages its private weights over time, w_i^l = beta_t w'_i^l + (1 - beta_t) w_i^{l-1}
       with beta_t ramped up as beta exp(-5 (1 - t/t0)^2) until round t0 = ``rampup`` T (Eq. 6-7),
    4. keeps the private channels and uploads the shared ones, w_0^t;

    the server averages the shared channels weighted by |D_i| (Eq. 1). A client is evaluated with its full network,
    its private channels and the global shared ones ("local test").

    Choices where the paper is silent (no code by its authors is public): which channels are private (the first n_l
    of every layer, :mod:`fedsilo.methods.channels`, where the parameter ownership is also set out); the channel
    count floor(p_t C_l); the cyclic distillation is skipped while some layer has no private (or no shared) channel,
    since one subnet then has no path to the logits (LeNet's 6-channel conv gets its first private channel at
    t = T/(6p): with T = 50 and p = 0.5 no distillation runs in rounds 1-16, a third of the paper's schedule, and that
    conv keeps one private channel until round 33; ceil would give it one from round 1, against p_t's small share);
    temperature 1, no stop-gradient; BatchNorm running statistics from the full network's forwards only; the EMA once
    per local epoch, as the text names Eq. 6's l "the local epoch number" (Algorithm 1's loop over l = 1..eta_i starts
    each pass by sampling a batch, which reads as once per step instead), on the private parameters, which training
    continues from: Eq. 6 writes w_i^l from w_i^(l-1) and "the raw update" w'_i^l, and training from the averaged
    weights makes TA a damping of the private channels' step, beta_t times the raw change each epoch (about 0.02,
    0.08, 0.22, 0.41 of it in the first rounds of the ramp, then 0.5); the other reading, a Mean-Teacher-style average
    kept beside raw weights that training continues from (Eq. 7 cites Mean Teacher for the ramp), is not built; the
    classifier's bias is shared and used by
    both subnets (slimmable networks' convention); BatchNorm running statistics of private channels are the full
    network's as trained, not averaged over time (the paper's LeNet-5 has no BatchNorm). The paper trains every client
    each round; with ``train.client_fraction`` < 1 a client downloads the shared part under the split of the last
    round it trained in (the server records it per site), so the channels that turned private meanwhile start from
    the global values of now, and it is evaluated with its private channels of that round and the global rest; a site
    that joins a run in progress (``joinable``) is such a client from the seeded initial model. The ablation
    switches are Table 5's LI / TA / CD; all three off is plain channel decoupling with a
    fixed ratio."""

    name = "cd2pfed"
    # the channel masks are forward hooks on the model the method was set up with, switched through the method
    client_parallel = False
    joinable = True  # the server's round record is made per site as it trains: a site may join mid-run
    params_cls = CD2PFedParams
    params: CD2PFedParams

    def newcomer_refusal(self) -> str:
        return ("a site's evaluation model holds as its own the channels of the split the server recorded as it took the "
                "site's upload, and a finished federation takes none from a newcomer")

    # --- the schedules of Eq. 3 and Eq. 7
    def ratio(self, rnd: int) -> float:
        """p_t of round ``rnd`` (1-based); round 0 (before training) has no private channel under LI."""
        if not self.params.progressive:
            return self.params.p
        total = self.params.ratio_rounds or self.train.rounds
        return self.params.p * min(rnd, total) / total

    def beta_t(self, rnd: int) -> float:
        t0 = self.params.rampup * (self.params.ratio_rounds or self.train.rounds)
        if rnd >= t0:
            return self.params.beta
        return self.params.beta * math.exp(-5.0 * (1.0 - rnd / t0) ** 2)

    # --- structure
    def check_backbone(self, model, example):
        self._partition(model)

    def _partition(self, model) -> ChannelPartition:
        try:
            return ChannelPartition(model)
        except ValueError as err:  # a layer channel decoupling cannot split (a ViT's LayerNorm, DenseNet's concatenations)
            raise ConfigError(f"methods.{self.key}: {err} (channel decoupling splits stacks of convolutions and linear "
                              "layers with the BatchNorm after each: every backbone here but densenet121 and vit_tiny; "
                              "train.model names the backbone)") from None

    def setup(self, model):
        self.part = self._partition(model)
        self.keys = list(model.state_dict().keys())
        self._final_private = self.part.private_fraction(model, self.part.counts_at(self.ratio(self.train.rounds)))

    def private_keys(self, model):
        # every whole tensor: shared channels only ever travel as ``<key>@shared`` slices
        return set(self.keys)

    def resolved(self) -> dict[str, Any]:
        if not hasattr(self, "part"):
            return {}
        return {
            "decoupled_layers": [layer.name for layer in self.part.layers],
            "private_channels_last_round": dict(zip((layer.name for layer in self.part.hidden), self.part.counts_at(self.ratio(self.train.rounds)))),
            "private_param_fraction_last_round": round(self._final_private, 6),
        }

    def init_server(self, model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def init_client(self, model, client):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def _last_counts(self, server: State, client) -> list[int]:
        """The channel split of the last round ``client`` trained in (none before its first)."""
        last = server.get(LAST + client.name)
        return self.part.counts_at(self.ratio(0 if last is None else int(last)))

    # --- a round
    def on_round_start(self, model, rnd):
        self.part.set_ratio(self.ratio(rnd))

    def download(self, server, client, rnd):
        # w_0 under the split the client last trained with: every row it does not hold as private
        return self.part.shared_part(server, self._last_counts(server, client))

    def local_update(self, model, store, payload, client, rnd, seed):
        model.load_state_dict(store, strict=True)
        with torch.no_grad():
            self.part.write(dict(model.state_dict(keep_vars=False)), payload)
        counts = self.part.counts
        weights = {k: p.detach() for k, p in model.named_parameters()}  # views of the parameters' storage
        terms: dict[str, Any] = {}
        if self.params.cyclic_distillation and self.params.lam > 0 and self.part.subnets_complete():
            def batch_loss(x, y, logits):
                with self.part.subnet(PRIVATE):
                    zl = model(x)
                with self.part.subnet(SHARED):
                    zg = model(x)
                return self.params.lam * cyclic_distillation(zl, zg)

            terms["batch_loss"] = batch_loss
        if self.params.temporal_averaging:
            private = self.part.private_views(weights, counts)
            previous = [v.detach().clone() for v in private]  # w_i^0: the private weights the round starts from
            beta = self.beta_t(rnd)

            def average(epoch: int) -> None:
                with torch.no_grad():
                    for v, prev in zip(private, previous):
                        v.mul_(beta).add_(prev, alpha=1.0 - beta)
                        prev.copy_(v)

            terms["epoch_hook"] = average
        self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index), **terms)
        sd = model.state_dict()
        for k in self.keys:
            store[k] = sd[k].detach().clone()
        return self.part.shared_part(sd, counts)

    streaming = True

    def agg_begin(self, server, rnd):
        return RunningMean(), []

    def agg_add(self, acc, client, upload):
        acc[0].add(client.n_train, upload)
        acc[1].append(client)

    def agg_end(self, server, acc, rnd):
        mean, trained = acc
        if mean.weight == 0:
            return server
        out = {k: v.clone() for k, v in server.items()}
        self.part.write(out, mean.result())
        for c in trained:
            out[LAST + c.name] = torch.tensor(rnd, dtype=torch.long)
        return out

    # --- evaluation
    def eval_download(self, server, client):
        """The global model and the site's own last round: the rounds the other sites trained in stay on the server."""
        mine = LAST + client.name
        return {k: v for k, v in server.items() if not k.startswith(LAST) or k == mine}

    def eval_state(self, server, store, client):
        # the client's private channels of the last round it trained in, the global values of every other one
        out = {k: v.clone() for k, v in store.items()}
        self.part.write(out, self.part.shared_part(server, self._last_counts(server, client)))
        return out
