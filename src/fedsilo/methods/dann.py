"""DANN + FL (pFedDIL's domain-adaptation baseline): domain-adversarial training (Ganin et al., JMLR 2016) inside
FedAvg, task after task."""

from __future__ import annotations

import math
from typing import Annotated, Any, Optional

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsilo.client.features import classifier, features, representation
from fedsilo.client.local import batches_per_epoch, make_generator, running_stats_frozen, train_local
from fedsilo.methods.base import MeanAggregation, MethodParams, spare_copy
from fedsilo.methods.continual import has, put, take
from fedsilo.models import LayeredNet

DISC, SRC = "disc.", "src."


class DANNParams(MethodParams):
    gamma: float = Field(10.0, gt=0, description="gamma of Ganin et al.'s adaptation schedule lambda_p = 2 / (1 + "
                         "exp(-gamma p)) - 1, p the training progress through the task (their value: 10)")
    disc_hidden: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1024, 1024],
        description="widths of the domain classifier's hidden layers (ReLU) between the feature extractor's output and "
        "its two domain logits; Ganin et al.'s deep models: x -> 1024 -> 1024 -> 2 ([] = a logistic regression)",
    )
    disc_dropout: float = Field(0.0, ge=0, lt=1, description="dropout after each hidden layer of the domain classifier")


class GradReverse(torch.autograd.Function):
    """Ganin et al.'s gradient reversal layer R_lambda: the identity forward, -lambda times the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lam: float) -> torch.Tensor:
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.neg() * ctx.lam, None


def grad_reverse(x: torch.Tensor, lam: float) -> torch.Tensor:
    return GradReverse.apply(x, lam)


def adaptation_factor(p: float, gamma: float = 10.0) -> float:
    """lambda_p = 2 / (1 + exp(-gamma p)) - 1 (Ganin et al. 2016's schedule, gamma = 10 there): 0 at p = 0, rising to
    ~1 at p = 1."""
    return 2.0 / (1.0 + math.exp(-gamma * p)) - 1.0


def domain_classifier(dim: int, hidden: list[int], dropout: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(dim, width), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        dim = width
    layers.append(nn.Linear(dim, 2))
    return nn.Sequential(*layers)


class DANN(MeanAggregation):
    """pFedDIL Sec. 4.1, "Domain Adaptation + FL": DANN (Ganin et al. 2016) "follows the domain adaptation paradigm
    which is different from the incremental learning setting and is often prone to issues like catastrophic
    forgetting". The paper says nothing more and we found no public code of it; what runs here:

    **The network** is the backbone as a feature extractor G_f (every layer before the last linear layer; its output
    z is the classifier's input) and a label classifier G_y (that last layer), plus a domain classifier G_d on z behind
    a gradient reversal layer (identity forward, -lambda_p x the gradient backward): x -> ``disc_hidden`` (ReLU) -> 2
    domain logits.

    **The two domains.** When task t (t >= 1) starts, the *source* is what the federation has learned of the earlier
    domains: the global model at the end of task t-1, frozen for the whole task (the server keeps it as ``src.*``).
    The *target* is the new domain, learned by the model being trained. A client holds the current task's images only,
    so both domains' samples are computed on them: source features z_s = G_f^(t-1)(x) of the frozen model (no gradient;
    in the trained model's mode, BatchNorm normalizing by the batch's statistics and leaving its running statistics
    as they are, so at a task's start, the same weights, z_s = z and G_d has nothing but what training changes to go
    on; in evaluation mode it would tell running from batch statistics apart), target features z = G_f(x) of the
    model in training. Per batch the client minimizes

        CE(G_y(z), y) + CE(G_d(z_s), source) + CE(G_d(R_lambda(z)), target)

    so G_d learns to tell the two representations apart while the reversed gradient drives G_f towards features G_d
    cannot tell from those the earlier domains' classifier was trained on; the label loss uses the new task's labels
    (every task of the stream is labeled). lambda_p = 2 / (1 + exp(-gamma p)) - 1 with p the progress through the
    *task*: p = ((r - 1) + s / S) / T for local step s of the client's S steps in the task's round r of T; each task
    is one adaptation (a new source, a fresh G_d), as one DANN training run is in Ganin et al., and it ramps again.
    Task 0 has no earlier domain: it is FedAvg exactly (no G_d, nothing extra sent).

    **Federation.** Shared, by FedAvg (sample-size-weighted mean): the whole model, G_f + G_y with BatchNorm
    statistics, and from task 1 on G_d (``disc.*``; reset to its seeded initialisation at every task start). The
    frozen source travels down only: a client announces (8 bytes) whether it already holds task t's source and
    downloads it (the whole model's state, so any head layer before the last linear layer is the source's too) once
    per task; it keeps it in its store (``src.*``, ``src_task``), declared private, never uploaded. **Evaluation**:
    every task's test images with the global model (no task identity, like FedAvg); G_d and the source play no part.

    Choices where the paper is open:

    - *Where the second domain comes from.* Weighed and rejected: the next task's unlabeled images as the target (the
      literal unsupervised-DA set-up, and one way the paper's DANN could differ from FedAvg already on the first task:
      96.07 vs 92.82 on MNIST, 51.97 vs 46.53 on Amazon; but a client of the stream has no future images, and the last
      task would have no target); stored features or feature statistics of earlier tasks' images (a feature replay
      memory the paper does not describe and no other baseline of its tables gets); a domain classifier over task
      identities (it would see one class only: the earlier tasks' images are gone); the round's downloaded global model
      as the second domain (a client-drift regularizer within a task, not adaptation across domains). The chosen
      source is the only trace of the earlier domains a client may keep under the stream's rules. What it departs from
      in Ganin et al.: G_d compares a frozen and a trained extractor on the same images (a fixed source encoder, as in
      ADDA, Tzeng et al. 2017), not one tied extractor on two image sets, so besides adapting to the new domain the
      adversarial term pulls the new representation's distribution towards the old one; it aligns distributions only,
      not each image's features, and the label loss sees the new domain alone, so forgetting is left to happen. With
      no source before the first task, our task-0 numbers equal FedAvg's, where the paper's do not.
    - *G_d federated* with the rest: every client of a task adapts the same pair (the same source, the same new
      domain), so one domain classifier serves them all, as one DANN network is averaged by FedAvg.
    - *Architecture*: x -> 1024 -> 1024 -> 2 (Ganin et al.'s domain classifier for their deeper networks; their MNIST
      one had a single 100-unit hidden layer), no dropout by default. Their learning-rate annealing
      mu_p = mu_0 / (1 + 10 p)^0.75 is not used: every method of the stream trains with the same local optimizer
      (pFedDIL: lr 1e-3, weight decay 1e-3), so the baselines differ by their objectives only.
    """

    name = "dann"
    params_cls = DANNParams
    params: DANNParams
    task_stream = True
    stream_only = True
    # the round's reversal strength and source data are set on the method by each local update
    client_parallel = False

    # ------------------------------------------------------------------ structure
    def setup(self, model: LayeredNet) -> None:
        self.keys = list(model.state_dict())
        self._init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        dim = classifier(model).in_features
        device = next(model.parameters()).device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.run_seed + 104729)
            self.disc = domain_classifier(dim, list(self.params.disc_hidden), self.params.disc_dropout).to(device)
        self._disc_init = {k: v.detach().clone() for k, v in self.disc.state_dict().items()}
        self._source: Optional[nn.Module] = None  # the frozen copy source features are computed with
        self.heard: dict[int, bool] = {}
        self.lambdas: list[float] = []  # lambda_p of every step of the latest local update (read by tests)

    def private_keys(self, model) -> set[str]:
        return {SRC + k for k in self.keys} | {"src_task"}

    def init_server(self, model):
        return {k: v.clone() for k, v in self._init.items()}

    def init_client(self, model, client):
        return {"src_task": torch.tensor([-1], dtype=torch.int64)}

    def on_task_start(self, server, model, task):
        if task == 0:
            return server
        server = {k: v for k, v in server.items() if not k.startswith((DISC, SRC))}
        put(server, SRC, {k: server[k] for k in self.keys})  # the global model at the end of the previous task
        put(server, DISC, self._disc_init)  # a fresh domain classifier for the new adaptation
        return server

    # ------------------------------------------------------------------ the schedule
    def progress(self, rnd: int, step: int, steps: int) -> float:
        """p: the progress through the current task at local step ``step`` of ``steps`` in round ``rnd``."""
        per_task = self.train.rounds
        return ((rnd - 1) % per_task + step / steps) / per_task

    # ------------------------------------------------------------------ a round
    def announce(self, model, store, client, rnd):
        if self.task == 0:
            return {}
        need = int(store["src_task"][0]) != self.task
        return {"need_source": torch.tensor([int(need)], dtype=torch.int64)}

    def hear(self, client, said):
        self.heard[client.index] = bool(int(said["need_source"][0]))

    def download(self, server, client, rnd):
        model = {k: server[k] for k in self.keys}
        if self.task == 0:
            return model
        out = {**model, **{k: v for k, v in server.items() if k.startswith(DISC)}}
        if self.heard.get(client.index, True):
            out.update({k: v for k, v in server.items() if k.startswith(SRC)})
        return out

    def domain_loss(self, z: torch.Tensor, z_src: torch.Tensor, lam: float) -> torch.Tensor:
        """Ganin et al.'s domain loss: G_d's cross entropy on the source features (label 0) and, through the gradient
        reversal layer, on the target features (label 1), each averaged over its samples."""
        zeros = torch.zeros(len(z_src), dtype=torch.long, device=z.device)
        ones = torch.ones(len(z), dtype=torch.long, device=z.device)
        src = F.cross_entropy(self.disc(z_src.detach()).float(), zeros)
        tgt = F.cross_entropy(self.disc(grad_reverse(z, lam)).float(), ones)
        return src + tgt

    def local_update(self, model, store, payload, client, rnd, seed):
        model.load_state_dict({k: payload[k] for k in self.keys}, strict=True)
        gen = make_generator(seed, rnd, client.index)
        self.lambdas = []
        if self.task == 0:  # no earlier domain yet: FedAvg's local update
            self.last_loss = train_local(model, client, self.train, gen)
            return {k: v.detach() for k, v in model.state_dict().items()}
        if has(payload, SRC):
            put(store, SRC, take(payload, SRC))
            store["src_task"] = torch.tensor([self.task], dtype=torch.int64)
        if self._source is None:
            self._source = spare_copy(model)
        source = self._source
        source.load_state_dict(take(store, SRC), strict=True)
        # in the trained model's mode (BatchNorm by the batch's statistics, its running statistics left as they are):
        # at a task's start both are the same weights and give the same features, so G_d separates what training
        # changed, not running against batch statistics
        source.train()
        self.disc.load_state_dict(take(payload, DISC), strict=True)
        self.disc.train()
        steps = self.train.local_epochs * batches_per_epoch(client.n_train, self.train.batch_size)
        with representation(model) as rep:

            def batch_loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
                lam = adaptation_factor(self.progress(rnd, len(self.lambdas), steps), self.params.gamma)
                self.lambdas.append(lam)
                with running_stats_frozen(source):
                    z_src = features(source, x)
                return self.domain_loss(rep.z, z_src, lam)

            self.last_loss = train_local(
                model, client, self.train, gen, batch_loss=batch_loss, params=[*model.parameters(), *self.disc.parameters()]
            )
        up = {k: v.detach() for k, v in model.state_dict().items()}
        up.update({DISC + k: v.detach() for k, v in self.disc.state_dict().items()})
        return up

    # ------------------------------------------------------------------ server
    def agg_end(self, server, acc, rnd):
        self.heard.clear()
        if acc.weight == 0:
            return server
        return {**server, **acc.result()}

    # ------------------------------------------------------------------ evaluation
    def eval_state(self, server, store, client):
        return {k: server[k] for k in self.keys}

    def global_state(self, server):
        return {k: server[k] for k in self.keys}

    def eval_is_global(self) -> bool:
        return True

    def resolved(self) -> dict[str, Any]:
        return {"disc_params": int(sum(p.numel() for p in self.disc.parameters()))} if hasattr(self, "disc") else {}
