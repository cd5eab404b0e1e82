"""FedCIL (Qi, Zhao & Li, ICLR 2023, "Better generative replay for continual federated learning"), pFedDIL's FedCIL
baseline: ACGAN generative replay with model consolidation on the server and consistency enforcement on the clients,
adapted from class- to domain-incremental learning."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsilo.client.data import ClientData
from fedsilo.client.features import Representation, input_of
from fedsilo.client.hostaug import host_policy
from fedsilo.client.local import lr_now, make_generator, running_stats_frozen, training_batches, use_bf16
from fedsilo.config import ConfigError, TrainParams
from fedsilo.methods.base import Method, MethodParams, RunningMean, State, payload_bytes, spare_copy
from fedsilo.methods.continual import has, put, take
from fedsilo.models import LayeredNet

RF, GEN, PREV = "rf.", "gen.", "prev."  # real/fake head, generator, replay generator G^{t-1}
INIT_STD = 0.02  # the authors' Server.gaussian_intiailize: conv/linear weights N(0, 0.02), biases 0, BatchNorm (1, 0)

Disc = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]  # (images, stands for data?) -> (real/fake logit, class logits)


class FedCILParams(MethodParams):
    lr: float = Field(1e-4, gt=0, description="Adam learning rate of discriminator and generator, on the clients and in "
                      "the server's consolidation (the authors' --lr; train.lr is not used); train.lr_schedule scales the "
                      "clients' rate, the server's consolidation keeps this one")
    beta1: float = Field(0.5, ge=0, lt=1, description="Adam beta1 (--beta1)")
    beta2: float = Field(0.99, ge=0, lt=1, description="Adam beta2 (--beta2)")
    weight_decay: float = Field(1e-5, ge=0, description="Adam weight decay (--weight-decay; train.weight_decay is not used)")
    importance: float = Field(0.5, ge=0, le=1, description="r: the discriminator loss is r * (current data) + (1 - r) * "
                              "(replayed data) (importance_of_new_task)")
    consistency_weight: float = Field(1.0, ge=0, description="factor on the consistency terms KD_d + KD_g1 + KD_g2 (the "
                                      "authors' released code multiplies them by 0; 0 reproduces it)")
    md_iter: int = Field(100, ge=0, description="steps of the server's model consolidation per round (--md_iter; 0: "
                         "FedAvg of the ACGANs only, the code's 'ACGAN + FedAvg')")
    gen_batch: int = Field(32, ge=1, description="synthetic images per participant and per consolidation batch (--gen_batch_size)")
    replay: bool = Field(True, description="generative replay of earlier tasks (false: the ACGAN fine-tuned task after task)")
    noise_dim: int = Field(100, ge=1, description="noise dimensions of z beside the one-hot class (110 = --generator-z-size at 10 classes)")
    gen_channels: int = Field(64, ge=1, description="c of the generator: 8c, 4c, 2c, c channels (--generator-g-channel-size)")
    gen_max_side: int = Field(32, ge=8, multiple_of=8, description="largest side the generator draws at; larger images "
                              "are its output resized (the authors drew 32 px)")


class ACGANGenerator(nn.Module):
    """The authors' generator (``FLAlgorithms/generator/gan.py: Generator``, DGR's WGAN generator): z = [one-hot(y),
    noise] -> FC to 8c x s/8 x s/8 -> BN, ReLU -> three 4x4 stride-2 transposed convolutions (4c, 2c, c) with BN and
    ReLU -> a 3x3 one to the image's channels -> tanh. It draws at ``draw`` (each side the image's rounded up to a
    multiple of 8, at most ``max_side``) and resizes bilinearly (antialiased) to the image size where that differs."""

    def __init__(self, num_classes: int, noise_dim: int, channels_out: int, size: tuple[int, int], c: int = 64, max_side: int = 32):
        super().__init__()
        self.num_classes, self.noise_dim, self.size = num_classes, noise_dim, (int(size[0]), int(size[1]))
        self.draw = tuple(min(8 * math.ceil(s / 8), max_side) for s in self.size)
        self.base = (self.draw[0] // 8, self.draw[1] // 8)
        self.fc = nn.Linear(num_classes + noise_dim, self.base[0] * self.base[1] * 8 * c)
        self.bn0 = nn.BatchNorm2d(8 * c)
        self.deconv1 = nn.ConvTranspose2d(8 * c, 4 * c, 4, 2, 1)
        self.bn1 = nn.BatchNorm2d(4 * c)
        self.deconv2 = nn.ConvTranspose2d(4 * c, 2 * c, 4, 2, 1)
        self.bn2 = nn.BatchNorm2d(2 * c)
        self.deconv3 = nn.ConvTranspose2d(2 * c, c, 4, 2, 1)
        self.bn3 = nn.BatchNorm2d(c)
        self.deconv4 = nn.ConvTranspose2d(c, channels_out, 3, 1, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        g = F.relu(self.bn0(self.fc(z).view(z.shape[0], -1, *self.base)))
        g = F.relu(self.bn1(self.deconv1(g)))
        g = F.relu(self.bn2(self.deconv2(g)))
        g = F.relu(self.bn3(self.deconv3(g)))
        g = torch.tanh(self.deconv4(g))
        if self.draw != self.size:
            # in float32: the antialiased kernel has no bfloat16 version (under autocast g may be bfloat16)
            g = F.interpolate(g.float(), size=self.size, mode="bilinear", align_corners=False, antialias=True)
        return g


def gaussian_init(module: nn.Module, std: float = INIT_STD) -> None:
    """The authors' ``gaussian_intiailize``: weights of linear and (transposed) convolution layers N(0, std), their
    biases 0; BatchNorm weight 1, bias 0."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def last_linear(model: LayeredNet) -> nn.Linear:
    """The classifier's last linear layer (the auxiliary classifier D_c of the ACGAN's discriminator)."""
    found = [m for m in model.units[-1].modules() if isinstance(m, nn.Linear)]
    if not found:
        raise ValueError("the model's last unit has no linear layer to serve as the ACGAN's auxiliary classifier")
    return found[-1]


def feature_tap(model: LayeredNet):
    """Inside the block every forward pass of ``model`` leaves the input of its last linear layer (the features D_c
    and D_s share) in the yielded ``.z``."""
    return input_of(last_linear(model))


def draw_labels(pool: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """n labels uniform over ``pool`` (a CPU vector of classes): the code's np.random.choice(classes, n)."""
    return pool[torch.randint(len(pool), (n,), generator=gen)]


def balanced(x: torch.Tensor, y: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' ``get_balanced_samples``: n labels uniform over the labels present in y (CPU), each with a random
    sample of that label from x."""
    labels = torch.unique(y)
    yb = labels[torch.randint(len(labels), (n,), generator=gen)]
    idx = torch.empty(n, dtype=torch.long)
    for i, lab in enumerate(yb.tolist()):
        cand = (y == lab).nonzero().flatten()
        idx[i] = cand[int(torch.randint(len(cand), (1,), generator=gen))]
    return x[idx.to(x.device)], yb


def present(v: torch.Tensor) -> torch.Tensor:
    """The classes of a presence vector, as a CPU index vector."""
    return v.detach().cpu().nonzero().flatten()


def union(*pools: torch.Tensor) -> torch.Tensor:
    return torch.unique(torch.cat([p.detach().cpu().long().flatten() for p in pools]))


class FedCIL(Method):
    """FedCIL as its authors' code runs it (github.com/daiqing98/FedCIL: ``FLAlgorithms/servers/serverpFedCL.py``,
    ``users/userpFedCL.py``, ``generator/model.py``; the losses and weights below are the code's), on pFedDIL's task
    stream and backbone.

    **The ACGAN.** The discriminator is the run's backbone: everything before its last linear layer is the shared
    trunk, the last linear layer is the auxiliary classifier D_c (the classifier that is evaluated) and a second linear
    layer on the same features, D_s (``rf.``), says real or fake: the authors' ``Critic`` (``fc`` and ``fc_aux`` on one
    flat feature) with the backbone in place of its three convolutions, since pFedDIL gives every method ResNet-18. The
    generator (``gen.``) is the authors' (:class:`ACGANGenerator`): z = [one-hot(y), N(0, I_100)] (110 dimensions at
    ten classes, their --generator-z-size), c = 64. It draws at each side of the image rounded up to a multiple of 8,
    at most ``gen_max_side`` = 32 (16 px: 16; 28 px: 32, resized to 28; 32 px: 32, the authors' side for MNIST, EMNIST
    and CIFAR-10); on larger images (64-256 px) the 32 px drawing is resized up, so the replay carries a domain's
    colours and coarse shapes but not its detail. D_s and the generator start from N(0, 0.02) weights and zero biases
    (their ``gaussian_intiailize``), the backbone from the run's initialisation.

    **Client, each round** (``UserpFedCL.train`` -> ``WGAN.train_a_batch_all``). It downloads the global ACGAN (trunk
    and D_c, D_s, generator) and two label sets the server knows, ``labels_past`` (classes heard in earlier tasks) and
    ``labels_all`` (those and the current task's so far); at its first round of a task t > 0 also the replay generator
    G^{t-1}, which it keeps for the task. Its classes so far are its current classes and ``labels_past``. For E epochs
    over its current task's data (augmented as ``train.augment`` says), for each batch (x, y) of B real images:

    - discriminator step: L_D = r * l(x, y) + (1 - r) * l(x~, y~) + w * (KD_d + KD_g1 + KD_g2), with l(x, y) =
      BCE(D_s(x), real) + CE(D_c(x), y) + BCE(D_s(G(z, y')), fake) + CE(D_c(G(z, y')), y') (B fakes of the client's
      generator, y' uniform over its classes so far); (x~, y~) are B images G^{t-1} draws at labels uniform over
      ``labels_past`` (t > 0 only; without replay L_D starts with l(x, y)), r = ``importance`` = 0.5;
    - consistency, from a task's second round on (the code's ``glob_iter_ != 0``), with G^ the downloaded global
      generator (frozen, eval mode): KD_d = KL(D_c(G^(z, y)) || D_c(x)) aligns the client's output on its real batch
      with its output on the global generator's images of the same labels; KD_g1 = KL(D_c(G^(z, y'')) || D_c(G(z',
      y''))) its outputs on the global and on its own generator's images of the same labels; KD_g2 = CE(D_c(G^(z,
      y'')), y''); y'' uniform over ``labels_all``; w = ``consistency_weight``;
    - generator step: BCE(D_s(G(z, y')), real) + CE(D_c(G(z, y')), y').

    Both with Adam (lr 1e-4, betas (0.5, 0.99), weight decay 1e-5: ``main.py``'s defaults, ``initialize_AC_GAN``).
    It uploads the whole ACGAN (trunk, D_c, D_s, generator and their BatchNorm statistics) and ``labels``, the presence
    vector of its current task's classes (one byte per class: the authors' server reads every client's label set).
    Between rounds it keeps G^{t-1} only.

    **Server** (``FedCL.train``: ``aggregate_parameters_``, then ``fine_tune_generator``). At each task's first round
    G^{t-1} := the global generator, and the ending task's labels join ``labels_past``. Each round: the sample-size-
    weighted mean of the uploaded ACGANs, then *model consolidation*, ``md_iter`` = 100 steps of the same ACGAN
    training (discriminator step with r = 0.5, generator step; a fresh Adam) on synthetic data only: each participant's
    uploaded generator draws ``gen_batch`` = 32 images at labels uniform over its uploaded classes, and ``gen_batch``
    of the pooled images, label-balanced (``get_balanced_samples``), stand in for the real batch; for t > 0 G^{t-1}
    draws the replayed batch at labels uniform over ``labels_past``; fakes come from the global generator at labels
    uniform over every class heard. The server never sees a client image: it has the uploaded weights and label sets.

    **Evaluated**: every client, on every task seen, with the global classifier (trunk + D_c) after the round's
    consolidation, as pFedDIL compares every method's global model. The authors' code instead scores each client once
    at the end with its own critic (``serverpFedCL.py``, ``userbase.py``), which is never the consolidated model, and
    pools the images (correct over images: our ``*_pooled`` numbers).

    **Domain- instead of class-incremental** (pFedDIL: "we adopt it to our FDIL setting"). In the authors' setting a
    task brings new classes: G^{t-1} is drawn at earlier tasks' classes, which the current data lack, and the classes so
    far grow with every task. Here every task has the same classes in a new domain: G^{t-1} is drawn at the classes of
    earlier tasks, which overlap the current ones, and its images are the earlier domains' images of those classes, so
    each discriminator step sees a class in the new domain (real batch) and in the old ones (replay); the classes so
    far are the union of current and earlier labels (under label skew a client's classes change from task to task).
    The losses, their weights and what travels are unchanged.

    Where code and paper part, and choices the code leaves open:

    - *Consistency enforcement* is one of FedCIL's two contributions, but the released ``train_a_batch_all`` adds its
      three terms with factor 0 (``# ablation``); they are on here with weight 1 each, ``consistency_weight: 0`` is the
      released code.
    - *The replay generator.* The code copies each client's own ACGAN when a task ends; every client is sent the
      global model every round, so that copy is the global model of the task's last round, or the client's own one-
      round update of it if it trained in that round. The engine sends nothing to a client that is not sampled, so a
      client's own copy could be tasks old under partial participation (pFedDIL's k = 0.4): here G^{t-1} is the global
      generator at the end of task t-1 for every client, and its replay labels are the classes the federation had in
      earlier tasks (the code: the client's own earlier classes, which a client sampled for the first time knows none
      of). The server's consolidation accordingly draws earlier tasks from that one generator instead of from each
      participant's copy.
    - *Optimisers.* A fresh Adam for each local update and each consolidation; the code's Adam state lives on in each
      client object and on the server across rounds. ``train.lr``, ``momentum`` and ``weight_decay`` are not used;
      ``train.batch_size``, ``local_epochs``, ``augment`` and ``amp`` are.
    - *Local work* is E epochs over the task's data (pFedDIL's E), not the code's fixed number of batches
      (``--local_epochs 400`` batches of 32 in ``run-ours.sh``).
    - *Averaging* takes every state entry, BatchNorm statistics included (the code averages parameters only).
    - *BatchNorm* (the authors' critic normalizes nothing). The backbone normalizes each batch by its own statistics in
      training, as the code's separate forward passes would; its running statistics, which the evaluated classifier
      uses, are moved only by the batches that stand for data, the real and the replayed one, not by the generators'
      fakes or the consistency images, and the server's consolidation leaves them at the clients' mean. Left to every
      batch, they are mostly those of generated images (two of three forward passes in a task's first round, six of
      eight later) and the classifier scores near chance: on the bar stream of ``tests/tiny.py`` (6 rounds) the
      first task's global classifier scored 0.43 with them, 1.0 with them re-estimated on its real images, and 0.80
      with them moved by the data batches only.
    - The client generators the server samples and G^{t-1} draw in training mode (batch statistics), the global
      generator in the consistency terms in eval mode, as in the code. The code runs the critic on the real batch a
      second time for KD_d; here the first forward's output is reused (same weights, same batch).
    """

    name = "fedcil"
    params_cls = FedCILParams
    params: FedCILParams
    own_optimizer = "its clients' Adam: methods.<key>.lr, beta1, beta2, weight_decay"
    task_stream = True
    stream_only = True
    # each local update logs its batches and device on the method
    client_parallel = False

    def __init__(self, params: FedCILParams, train: TrainParams, key: Optional[str] = None):
        super().__init__(params, train, key)
        if not self.train.normalize.minus_one_one:  # a fake would sit on another scale than the real images it joins
            raise ConfigError(f"train.normalize: {self.key} (FedCIL) draws its generator's images on [-1, 1] (tanh), the "
                              "scale its discriminator sees the real images on; keep the default (mean 0.5, std 0.5)")

    # ------------------------------------------------------------------ structure
    def transform_model(self, model, example):
        self.image_shape = tuple(int(s) for s in example.shape[1:])  # (C, H, W): the generator draws these
        return model

    def check_backbone(self, model, example):
        self.classifier(model)

    def classifier(self, model: LayeredNet) -> nn.Linear:
        """The backbone's last linear layer: D_c of the ACGAN's discriminator."""
        try:
            return last_linear(model)
        except ValueError as err:
            raise ConfigError(f"methods.{self.key}: {err} (train.model names the backbone)") from None

    def setup(self, model: LayeredNet) -> None:
        self.keys = list(model.state_dict())
        lin = self.classifier(model)
        self.num_classes = int(lin.out_features)
        self.device = lin.weight.device
        c_img, h, w = self.image_shape
        p = self.params
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.run_seed + 104_729)
            self.rf = nn.Linear(lin.in_features, 1)
            self.gen = ACGANGenerator(self.num_classes, p.noise_dim, c_img, (h, w), p.gen_channels, p.gen_max_side)
            gaussian_init(self.rf)
            gaussian_init(self.gen)
        self.rf.to(self.device)
        self.gen.to(self.device)
        self._rf_init = {k: v.detach().clone() for k, v in self.rf.state_dict().items()}
        self._gen_init = {k: v.detach().clone() for k, v in self.gen.state_dict().items()}
        self.glob = spare_copy(self.gen)  # the downloaded global generator G^ (consistency terms)
        self.prev = spare_copy(self.gen)  # the replay generator G^{t-1}
        self._server_disc = spare_copy(model)  # the server's copy of the ACGAN for the consolidation
        self._server_rf = spare_copy(self.rf)
        self._server_gen = spare_copy(self.gen)
        # per client of the latest round: real, replayed and consistency images its discriminator saw; and the
        # latest consolidation's synthetic stand-ins and replayed images (diagnostics)
        self.batch_log: dict[str, dict[str, int]] = {}
        self.server_log: dict[str, int] = {}

    def private_keys(self, model) -> set[str]:
        return {PREV + k for k in self._gen_init}

    def _task(self) -> int:
        return int(getattr(self, "task", 0))

    def _round_in_task(self, rnd: int) -> int:
        return (rnd - 1) % self.train.rounds  # the continual engine runs train.rounds rounds per task

    def _amp(self, enabled: bool) -> torch.autocast:
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _adam(self, params: list[nn.Parameter]) -> torch.optim.Adam:
        p = self.params
        return torch.optim.Adam(params, lr=lr_now(p.lr), betas=(p.beta1, p.beta2), weight_decay=p.weight_decay)

    # ------------------------------------------------------------------ state
    def init_server(self, model):
        server = {k: v.detach().clone() for k, v in model.state_dict().items()}
        put(server, RF, self._rf_init)
        put(server, GEN, self._gen_init)
        n = max((c.index for c in self.federation), default=-1) + 1
        server["labels_past"] = torch.zeros(self.num_classes, dtype=torch.uint8, device=self.device)
        server["labels_now"] = torch.zeros(self.num_classes, dtype=torch.uint8, device=self.device)
        server["prev_sent"] = torch.full((n,), -1, dtype=torch.int64, device=self.device)  # last task G^{t-1} went to client k
        return server

    def init_client(self, model, client):
        return {}

    def on_task_start(self, server, model, task):
        if task == 0:
            return server
        server = dict(server)
        put(server, PREV, take(server, GEN))  # G^{t-1}: the global generator at the end of the previous task
        server["labels_past"] = server["labels_past"] | server["labels_now"]
        server["labels_now"] = torch.zeros_like(server["labels_now"])
        return server

    def on_round_start(self, model, rnd):
        self.batch_log = {}
        self.server_log = {}

    # ------------------------------------------------------------------ the ACGAN's pieces
    def _z(self, labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """The authors' generate_noise_with_classes: N(0, 1) noise whose first ``classes`` entries are the one-hot class."""
        noise = torch.randn(len(labels), self.params.noise_dim, generator=gen).to(self.device)
        return torch.cat([F.one_hot(labels.to(self.device), self.num_classes).float(), noise], 1)

    @staticmethod
    def _disc(model: nn.Module, rf: nn.Module, seen: Representation, data_stats: bool = True) -> Disc:
        """The discriminator as a function: images -> (D_s logit, D_c logits). ``d(x, data=True)`` marks a batch that
        stands for data (a real or a replayed batch): only those move the BatchNorm running statistics, and none does
        when ``data_stats`` is false (the server's consolidation)."""

        def d(x: torch.Tensor, data: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            with nullcontext() if data and data_stats else running_stats_frozen(model):
                logits = model(x)
            return rf(seen.z).squeeze(1).float(), logits.float()

        return d

    def _d_loss(self, d: Disc, g: nn.Module, x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor,
                rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The code's ``_c_loss``: the ACGAN discriminator loss on a real (or stand-in) batch and on as many fakes of
        ``g`` at labels uniform over ``pool``; also returns the class logits of the batch."""
        s, c = d(x, True)
        loss = F.binary_cross_entropy_with_logits(s, torch.ones_like(s)) + F.cross_entropy(c, y.to(c.device))
        yf = draw_labels(pool, len(x), rng)
        with torch.no_grad():  # the generator is not updated by this loss (the code's fake.detach())
            fake = g(self._z(yf, rng))
        s_f, c_f = d(fake)
        loss = loss + F.binary_cross_entropy_with_logits(s_f, torch.zeros_like(s_f)) + F.cross_entropy(c_f, yf.to(c_f.device))
        return loss, c

    def _g_step(self, d: Disc, d_params: list[nn.Parameter], g: nn.Module, opt: torch.optim.Optimizer, n: int,
                pool: torch.Tensor, rng: torch.Generator, bf16: bool) -> torch.Tensor:
        """The code's ``_g_loss`` and generator step: BCE(D_s(G(z, y)), real) + CE(D_c(G(z, y)), y)."""
        y = draw_labels(pool, n, rng)
        flags = [q.requires_grad for q in d_params]
        for q in d_params:  # the discriminator is not updated by this step: no gradients for its weights
            q.requires_grad_(False)
        try:
            with self._amp(bf16):
                s, c = d(g(self._z(y, rng)))
                loss = F.binary_cross_entropy_with_logits(s, torch.ones_like(s)) + F.cross_entropy(c, y.to(c.device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        finally:
            for q, f in zip(d_params, flags):
                q.requires_grad_(f)
        return loss.detach()

    def _consistency(self, d: Disc, real_logits: torch.Tensor, y: torch.Tensor, pool: torch.Tensor,
                     rng: torch.Generator) -> torch.Tensor:
        """KD_d + KD_g1 + KD_g2 of the code's ``train_a_batch_all`` (see the class docstring)."""
        with torch.no_grad():
            fake_server = self.glob(self._z(y, rng))
        _, p_server = d(fake_server)
        kd_d = F.kl_div(F.log_softmax(real_logits, 1), F.softmax(p_server, 1), reduction="batchmean")
        yc = draw_labels(pool, len(y), rng)
        with torch.no_grad():
            fake_server = self.glob(self._z(yc, rng))
            fake_own = self.gen(self._z(yc, rng))
        _, c_server = d(fake_server)
        _, c_own = d(fake_own)
        kd_g1 = F.kl_div(F.log_softmax(c_own, 1), F.softmax(c_server, 1), reduction="batchmean")
        kd_g2 = F.cross_entropy(c_server, yc.to(c_server.device))
        return kd_d + kd_g1 + kd_g2

    # ------------------------------------------------------------------ a round
    def download(self, server, client, rnd):
        out = {k: server[k] for k in self.keys}
        out.update({k: v for k, v in server.items() if k.startswith((RF, GEN))})
        out["labels_past"] = server["labels_past"]
        out["labels_all"] = server["labels_past"] | server["labels_now"]
        t = self._task()
        if t > 0 and self.params.replay and int(server["prev_sent"][client.index]) < t:
            out.update({k: v for k, v in server.items() if k.startswith(PREV)})  # G^{t-1}, once per task
        return out

    def local_update(self, model, store, payload, client: ClientData, rnd, seed):
        p, t = self.params, self._task()
        if has(payload, PREV):
            put(store, PREV, take(payload, PREV))
        model.load_state_dict({k: payload[k] for k in self.keys}, strict=True)
        self.rf.load_state_dict(take(payload, RF), strict=True)
        self.gen.load_state_dict(take(payload, GEN), strict=True)
        current = torch.unique(client.y_train.detach().cpu())
        past = present(payload["labels_past"])
        so_far = union(current, past)
        everything = union(present(payload["labels_all"]), current)
        replay = p.replay and t > 0 and len(past) > 0 and has(store, PREV)
        if replay:
            self.prev.load_state_dict(take(store, PREV), strict=True)
            self.prev.train()  # the code draws its copy of the old generator in training mode
        consistent = p.consistency_weight > 0 and self._round_in_task(rnd) > 0
        if consistent:
            self.glob.load_state_dict(take(payload, GEN), strict=True)
            self.glob.eval()  # generator_server.eval()
        d_params = [*model.parameters(), *self.rf.parameters()]
        opt_d, opt_g = self._adam(d_params), self._adam(list(self.gen.parameters()))
        model.train()
        self.rf.train()
        self.gen.train()
        dev = client.x_train.device
        bf16 = use_bf16(self.train, dev)
        gb = make_generator(seed, rnd, client.index)  # batch order and augmentation (training_batches, as train_local)
        rng = make_generator(seed, rnd, client.index, 1)  # labels and noise of the synthetic images
        log = {"real": 0, "replay": 0, "consistency": 0}
        last = 0.0
        host = host_policy(self.train.augment.host)  # train.augment.host, as train_local applies it
        with feature_tap(model) as seen:
            d = self._disc(model, self.rf, seen)
            for epoch in range(self.train.local_epochs):
                total = torch.zeros((), device=dev)
                count = 0
                for x, y in training_batches(client, self.train, gb, host):
                    b = len(y)
                    with self._amp(bf16):
                        loss, real_logits = self._d_loss(d, self.gen, x, y, so_far, rng)
                        log["real"] += b
                        if replay:
                            yr = draw_labels(past, b, rng)
                            with torch.no_grad():
                                xr = self.prev(self._z(yr, rng))
                            loss_r, _ = self._d_loss(d, self.gen, xr, yr, so_far, rng)
                            loss = p.importance * loss + (1 - p.importance) * loss_r
                            log["replay"] += b
                        if consistent:
                            loss = loss + p.consistency_weight * self._consistency(d, real_logits, y, everything, rng)
                            log["consistency"] += 3 * b
                    opt_d.zero_grad(set_to_none=True)
                    loss.backward()
                    opt_d.step()
                    self._g_step(d, d_params, self.gen, opt_g, b, so_far, rng, bf16)
                    total += loss.detach().float() * b
                    count += b
                last = float(total) / max(count, 1)
                if not math.isfinite(last):
                    raise ConfigError(f"methods.{self.key}.lr: the ACGAN's local training diverged (mean discriminator "
                                      f"loss {last} in local epoch {epoch + 1} with lr {opt_d.param_groups[0]['lr']:.4g}); lower the learning rate")
        opt_d.state.clear()
        opt_g.state.clear()
        self.last_loss = last
        self.batch_log[client.name] = log
        sd = model.state_dict()
        up = {k: sd[k].detach() for k in self.keys}
        up.update({RF + k: v.detach() for k, v in self.rf.state_dict().items()})
        up.update({GEN + k: v.detach() for k, v in self.gen.state_dict().items()})
        labels = torch.zeros(self.num_classes, dtype=torch.uint8, device=self.device)
        labels[current.to(self.device)] = 1
        up["labels"] = labels
        return up

    # ------------------------------------------------------------------ server
    def aggregate(self, server, uploads, rnd):
        if not uploads:
            return server
        acc = RunningMean()
        for c, up in uploads:
            acc.add(c.n_train, {k: v for k, v in up.items() if k != "labels"})
        server = {**server, **acc.result()}
        now = server["labels_now"].clone()
        for _, up in uploads:
            now |= up["labels"].to(now.device)
        server["labels_now"] = now
        t = self._task()
        if t > 0 and self.params.replay:  # the participants now hold G^{t-1}
            sent = server["prev_sent"].clone()
            for c, _ in uploads:
                sent[c.index] = t
            server["prev_sent"] = sent
        if self.params.md_iter > 0:
            self.consolidate(server, uploads, rnd)
        return server

    def consolidate(self, server: State, uploads: list[tuple[ClientData, State]], rnd: int) -> None:
        """Model consolidation (the code's ``fine_tune_generator``), in place on ``server``: ``md_iter`` steps of ACGAN
        training of the aggregated global model on images drawn from the participants' uploaded generators (and from
        G^{t-1} for earlier tasks). Reads the uploads' weights and label sets only."""
        p, t = self.params, self._task()
        disc, rf, g = self._server_disc, self._server_rf, self._server_gen
        disc.load_state_dict({k: server[k] for k in self.keys}, strict=True)
        rf.load_state_dict(take(server, RF), strict=True)
        g.load_state_dict(take(server, GEN), strict=True)
        sources = []
        for _, up in uploads:
            labels = present(up["labels"])
            if len(labels):
                gk = spare_copy(self.gen)
                gk.load_state_dict(take(up, GEN), strict=True)
                gk.train()  # the code samples the clients' generators as they are left, in training mode
                sources.append((gk, labels))
        if not sources:
            return
        past = present(server["labels_past"])
        every = present(server["labels_past"] | server["labels_now"])
        replay = p.replay and t > 0 and len(past) > 0 and has(server, PREV)
        if replay:
            self.prev.load_state_dict(take(server, PREV), strict=True)
            self.prev.train()
        d_params = [*disc.parameters(), *rf.parameters()]
        opt_d, opt_g = self._adam(d_params), self._adam(list(g.parameters()))
        disc.train()
        rf.train()
        g.train()
        rng = make_generator(self.run_seed, rnd, 2_000_003)
        bf16 = use_bf16(self.train, self.device)
        n = p.gen_batch
        log = self.server_log = {"synthetic": 0, "replay": 0}
        with feature_tap(disc) as seen:
            d = self._disc(disc, rf, seen, data_stats=False)
            for _ in range(p.md_iter):
                with torch.no_grad(), self._amp(bf16):
                    xs, ys = [], []
                    for gk, lk in sources:  # each participant's generator at its own current classes, pooled
                        yk = draw_labels(lk, n, rng)
                        xs.append(gk(self._z(yk, rng)).float())
                        ys.append(yk)
                    x, y = balanced(torch.cat(xs), torch.cat(ys), n, rng)
                    log["synthetic"] += n
                    if replay:
                        yr = draw_labels(past, n, rng)
                        xr = self.prev(self._z(yr, rng)).float()
                        log["replay"] += n
                with self._amp(bf16):
                    loss, _ = self._d_loss(d, g, x, y, every, rng)
                    if replay:
                        loss_r, _ = self._d_loss(d, g, xr, yr, every, rng)
                        loss = p.importance * loss + (1 - p.importance) * loss_r
                opt_d.zero_grad(set_to_none=True)
                loss.backward()
                opt_d.step()
                self._g_step(d, d_params, g, opt_g, n, every, rng, bf16)
        for k, v in disc.state_dict().items():
            server[k] = v.detach().clone()
        put(server, RF, rf.state_dict())
        put(server, GEN, g.state_dict())

    # ------------------------------------------------------------------ evaluation
    def eval_state(self, server, store, client):
        return {k: server[k] for k in self.keys}

    def global_state(self, server) -> Optional[State]:
        return {k: server[k] for k in self.keys}

    def eval_is_global(self) -> bool:
        return True

    def storage(self, server, store):
        """One classifier (the discriminator's class head on its trunk), and what the client keeps to learn the next
        task: the real/fake head and the global generator it replays from."""
        kept = {**self.global_state(server), **take(server, RF), **take(server, GEN)}
        return {"models": 1, "bytes": payload_bytes(kept)}

    def resolved(self) -> dict[str, object]:
        if not hasattr(self, "gen"):
            return {}
        return {
            "generator_params": int(sum(q.numel() for q in self.gen.parameters())),
            "generator_draw_side": list(self.gen.draw),
            "real_fake_head_params": int(sum(q.numel() for q in self.rf.parameters())),
        }
