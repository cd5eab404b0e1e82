"""FDSE: federated domain shift eraser (Zheng Wang, Zihui Wang, Zheng Wang, Xiaoliang Fan, Cheng Wang; CVPR 2025)."""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsilo.client.features import classifier
from fedsilo.client.local import make_generator, train_local
from fedsilo.config import ConfigError
from fedsilo.methods.base import MethodParams, State
from fedsilo.methods.decoupling import DecouplingParams
from fedsilo.methods.sharing import PartialSharing
from fedsilo.models import LayeredNet

PERSONAL = "fdse::"  # the server's copy of each client's personalized tensors: fdse::<client>::<key>
START = "fdse_start::"  # the seeded initial model's personalized tensors: a site's until the server mixes its own
TRAINED = "fdse_trained::"  # a client's copy of the shared tensors it last trained (``evaluate: trained``; its
# trained erasers are its store's own personal tensors)


class DSEConv(nn.Module):
    """One layer as FDSE's code builds it (``DSEConv``, ratio 2): a shared domain-free extractor ``dfe_conv`` (the
    original convolution's kernel, stride and padding, ceil(out/2) channels, with bias) normalized by ``dse_bn``, a
    personalized depthwise 3x3 domain-shift eraser ``dse_conv`` on that, both concatenated (cut to ``out``
    channels), plus ``dfe_bias``, then the shared ``dfe_bn`` and a ReLU when the original had one."""

    def __init__(self, inp: int, out: int, kernel_size: int, stride: int, padding: int, relu: bool):
        super().__init__()
        half = math.ceil(out / 2)
        self.out = out
        self.dfe_conv = nn.Conv2d(inp, half, kernel_size, stride, padding, bias=True)
        self.dse_bn = nn.BatchNorm2d(half)
        self.dfe_bias = nn.Parameter(torch.zeros(out))
        self.dse_conv = nn.Conv2d(half, half, 3, 1, 1, groups=half, bias=False)
        self.dfe_bn = nn.BatchNorm2d(out)
        self.relu = relu

    @classmethod
    def like(cls, conv: nn.Conv2d, relu: bool) -> "DSEConv":
        return cls(conv.in_channels, conv.out_channels, conv.kernel_size[0], conv.stride[0], conv.padding[0], relu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.dse_bn(self.dfe_conv(x))
        x = torch.cat([x1, self.dse_conv(x1)], 1)[:, : self.out] + self.dfe_bias.view(1, -1, 1, 1)
        x = self.dfe_bn(x)
        return F.relu(x) if self.relu else x


class DSEBasicBlock(nn.Module):
    """A ResNet BasicBlock with each conv + BN (and the downsampling 1x1 conv + BN) as a DSE layer."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.conv1 = DSEConv.like(block.conv1, relu=True)
        self.conv2 = DSEConv.like(block.conv2, relu=False)
        ds = block.downsample
        # a 1x1 conv + BN shortcut becomes a DSE layer; a parameter-free one (the CIFAR ResNets' zero-padding
        # option A, resnet32) has no convolution to convert and stays as it is
        self.downsample = DSEConv.like(ds[0], relu=False) if isinstance(ds, nn.Sequential) else ds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.conv1(x))
        identity = self.downsample(x) if self.downsample is not None else x  # after conv2, as torchvision's block runs
        return F.relu(out + identity)


def dse_resnet(model: LayeredNet) -> LayeredNet:
    """FDSE's conversion rule (every conv + BN becomes a DSE layer, the classifier stays a plain linear layer)
    applied to a torchvision-style ResNet LayeredNet; FDSE's code converts only AlexNet."""
    from torchvision.models.resnet import BasicBlock

    units: list[tuple[str, nn.Module, int]] = []
    for name, unit, depth in model.layers():
        if name == "stem":
            conv = next(m for m in unit.modules() if isinstance(m, nn.Conv2d))
            rest = [m for m in unit if isinstance(m, nn.MaxPool2d)]
            units.append((name, nn.Sequential(DSEConv.like(conv, relu=True), *rest), depth))
        elif isinstance(unit, BasicBlock):
            units.append((name, DSEBasicBlock(unit), depth))
        elif name == model.unit_names[-1]:
            units.append((name, unit, depth))
        else:
            raise ValueError(f"cannot convert unit {name!r} ({type(unit).__name__}); FDSE here needs a BasicBlock ResNet "
                             "(resnet10, resnet10_cifar, resnet18, resnet34, resnet34_cifar, resnet32; train.model names the backbone)")
    return LayeredNet(units, head_units=model.head_units).to(next(model.parameters()).device)


class FDSEParams(MethodParams):
    lam: float = Field(0.01, ge=0, description="lambda: weight of the statistics-consistency regularizer (code default 0.01; PACS 0.5, Office 0.05)")
    tau: float = Field(0.5, gt=0, description="temperature of the similarity-weighted aggregation of the erasers")
    beta: float = Field(0.1, description="layer weights softmax(beta * l): deeper layers weigh more for beta > 0 (PACS 0.001, Office 0.05)")
    regularizer: Literal["code", "kl"] = Field(
        "code", description="code: the released code's formula; kl: the per-channel Gaussian KL(N(g, v) || N(mu, s^2))"
    )
    clip_grad: Optional[float] = Field(10.0, gt=0, description="gradient-norm clipping of the local steps (FDSE's configs: 10)")
    evaluate: Literal["trained", "next_round"] = Field(
        "trained", description="the model a client is evaluated with: trained = the model it trained in its last round, as "
        "the authors' code tests each client's model before the server's step; next_round = the aggregated shared part, "
        "the erasers the server mixed for it and its own statistics (the model it starts its next round with)",
    )
    decouple: Optional[DecouplingParams] = Field(None, description="F²DC's DFD and DFC plugged in (F²DC Table 3)")


def min_norm_weights(u: np.ndarray) -> np.ndarray:
    """argmin_{lambda in simplex} ||sum_i lambda_i u_i||^2 for the rows u_i (MGDA's min-norm point), by SLSQP."""
    from scipy.optimize import minimize

    n = len(u)
    if n == 1:
        return np.ones(1)
    m = u @ u.T
    res = minimize(lambda lam: lam @ m @ lam, np.full(n, 1.0 / n), jac=lambda lam: 2 * m @ lam, method="SLSQP",
                   bounds=[(0.0, 1.0)] * n, constraints=[{"type": "eq", "fun": lambda lam: lam.sum() - 1.0, "jac": lambda lam: np.ones(n)}],
                   options={"ftol": 1e-12, "maxiter": 500})
    if not res.success:
        raise RuntimeError(f"fdse: MGDA's min-norm weights of {n} updates were not found (SLSQP: {res.message})")
    lam = np.clip(res.x, 0.0, None)
    return lam / lam.sum()  # the simplex the solver met up to its tolerance, exactly


def is_personal(key: str) -> bool:
    return ".dse_conv." in key or key.endswith((".dse_bn.weight", ".dse_bn.bias"))


class FDSE(PartialSharing):
    """Wang et al. 2025 (CVPR), as the authors' code runs it (github:WwZzz/FDSE_CVPR25, ``algorithm/fdse.py``), on
    the ResNet the F²DC comparison uses. Every conv + BN of the backbone is a DSE layer: a domain-free extractor
    (``dfe_*``, shared with the head) and a domain-shift eraser (``dse_conv`` and ``dse_bn``'s affine terms,
    personalized; ``dse_bn``'s running statistics never leave the client). A client downloads the shared tensors
    and its personalized erasers, trains on CE + lambda * R (from round 2) with gradient clipping, and uploads both.
    R pulls the statistics of the input of every ``dfe_bn`` towards the downloaded running statistics, layer l
    weighted by softmax(beta l). The server updates each shared tensor by the min-norm point of the clients'
    unit-normalized updates (MGDA), scaled by their mean norm; BatchNorm running statistics by their plain mean;
    and gives each client, per personalized tensor, the softmax(cos / tau)-weighted mix of all participants'
    erasers (itself included); a site not yet mixed for (before its first upload; a site that joins a run in
    progress, ``joinable``) downloads the initial model's erasers, as every site started from them.

    Choices: ``regularizer: code`` is the released formula (channel-averaged batch means and their spread across
    channels, chained by a 0.1-momentum average across layers and steps, mean term (g^2 - f^2) / 2v), which is not
    a Gaussian KL; ``kl`` is the per-channel KL(N(g, v) || N(mu, s^2)) the paper describes. The code converts only
    AlexNet; here FDSE's rule (every conv + BN, the classifier plain) is applied to ResNet's BasicBlocks, with a
    block's downsampling layer run after its two convolutions (torchvision's order; layer l of the regularizer's
    softmax(beta l) counts conv1, conv2, downsample). FDSE has no single global model (its erasers are per client).
    The code's logger tests each client's own model after the round's aggregation (``log_once`` after
    ``iterate``), which the server's step leaves as the client trained it: the model the client trained in its last
    round, the initial model before it has trained (``evaluate: trained``, the default); ``next_round`` evaluates the shared part, the erasers the server mixed for the client and its own
    eraser statistics instead. The optimizer (momentum, weight decay, learning rate) is the preset's; the
    code's per-round learning-rate decay (0.9998, ``train.lr_schedule: {kind: exponential, gamma: 0.9998}``) is not
    in the presets (every method of F²DC's tables trains at the table's one rate); the code sums BatchNorm's step counters across clients
    (K-fold growth a round), we average them (unused with BatchNorm's momentum 0.1)."""

    name = "fdse"
    params_cls = FDSEParams
    params: FDSEParams
    joinable = True  # a site's personalized part is made by the server's first mix of its upload: a site may join mid-run

    def transform_model(self, model, example):
        try:
            dse = dse_resnet(model)
        except ValueError as err:
            raise ConfigError(f"methods.{self.key}: {err}") from None
        return super().transform_model(dse, example)

    def shared_keys(self, model: LayeredNet) -> list[str]:
        if self.params.decouple is not None and self.params.decouple.share_modules:
            raise ConfigError(f"methods.{self.key}.decouple.share_modules: FDSE shares its extractors' dfe layers and the "
                              "head only; F²DC's modules stay on the clients here (set it false)")
        head = {n for n, m in model.named_modules() if m is classifier(model)}
        return [k for k in model.state_dict() if ".dfe_" in k or any(k.startswith(h + ".") for h in head)]

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        self.personal = [k for k in self.private if is_personal(k)]

    def private_keys(self, model: LayeredNet) -> set[str]:
        """What never leaves a client: the erasers' BatchNorm running statistics (the erasers themselves travel) and
        its copy of the model it last trained."""
        return {k for k in self.private if not is_personal(k)} | {TRAINED + k for k in model.state_dict()}

    def init_client(self, model: LayeredNet, client) -> State:
        store = super().init_client(model, client)
        if self.params.evaluate == "trained":  # before it trains, a client holds the initial model (as in the code)
            sd = model.state_dict()
            store.update({TRAINED + k: sd[k].detach().clone() for k in self.shared})
        return store

    def init_server(self, model: LayeredNet) -> State:
        sd = model.state_dict()
        return {**super().init_server(model), **{START + k: sd[k].detach().clone() for k in self.personal}}

    def newcomer_refusal(self) -> str:
        return ("a site's evaluation model holds the personalized layers the server mixes for it from the round's "
                "uploads, and a finished federation takes none from a newcomer")

    def own_part(self, server: State, client) -> State:
        """The personalized tensors the server holds for ``client``: those it mixed for the site in the site's last
        round, the initial ones before its first (every site's start, a site that joins a run in progress too)."""
        mine = f"{PERSONAL}{client.name}::"
        return {k: server[mine + k] if mine + k in server else server[START + k] for k in self.personal}

    def download(self, server: State, client, rnd: int) -> State:
        return {**{k: server[k] for k in self.shared}, **self.own_part(server, client)}

    # --- the client
    def regularizer(self, inputs: list[torch.Tensor], ref: list[tuple[torch.Tensor, torch.Tensor]], state: dict) -> torch.Tensor:
        n = len(inputs)
        w = torch.softmax(self.params.beta * torch.arange(n, dtype=torch.float32), 0).tolist()
        total = torch.zeros((), device=inputs[0].device)
        if self.params.regularizer == "kl":
            for wl, x, (g, v) in zip(w, inputs, ref):
                dims = [0, 2, 3] if x.dim() == 4 else [0]
                mu, var = x.float().mean(dims), x.float().var(dims, unbiased=False) + 1e-5
                kl = 0.5 * torch.log(var / (v + 1e-5)) + (v + (g - mu) ** 2) / (2 * var) - 0.5
                total = total + wl * kl.mean()
            return total
        m = 0.1
        for wl, x, (g, v) in zip(w, inputs, ref):
            f = x.float().mean(dim=[0, 2, 3]) if x.dim() == 4 else x.float().mean(0)
            mf, vf = f.mean(), f.var()
            state["fn"] = mf if state.get("fn") is None else (1 - m) * state["fn"] + m * mf
            state["vn"] = vf if state.get("vn") is None else (1 - m) * state["vn"] + m * vf
            fn, vn = state["fn"], state["vn"]
            total = total + wl * ((g**2 - fn**2) / (2 * vn)).mean()
            total = total + wl * 0.5 * (torch.log(vn / (v + 1e-8)) + v / (vn + 1e-8)).mean()
        return total

    def local_update(self, model, store, payload, client, rnd, seed):
        model.load_state_dict({**{k: store[k] for k in self.private}, **payload}, strict=True)
        # the DFE BatchNorms of the model this client trains (a copy of the engine's when clients train in parallel),
        # layer l in module order; each input lands in its own layer's slot, whatever order the forward runs them in
        bn_layers = [m for m in model.modules() if isinstance(m, DSEConv)]
        slots: list[Optional[torch.Tensor]] = [None] * len(bn_layers)

        def capture(i: int):
            def hook(_m: nn.Module, inp: tuple[torch.Tensor, ...]) -> None:
                slots[i] = inp[0]
            return hook

        handles = [layer.dfe_bn.register_forward_pre_hook(capture(i)) for i, layer in enumerate(bn_layers)]
        ref = [(layer.dfe_bn.running_mean.detach().clone().float(), layer.dfe_bn.running_var.detach().clone().float()) for layer in bn_layers]
        state: dict[str, Any] = {}
        lam = self.params.lam if rnd > 1 else 0.0

        def batch_loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            inputs = list(slots)
            slots[:] = [None] * len(slots)
            if lam == 0:
                return torch.zeros((), device=y.device)
            if any(t is None for t in inputs):
                raise RuntimeError("fdse: a DSE layer's BatchNorm saw no input in this step")
            return lam * self.regularizer(inputs, ref, state)  # type: ignore[arg-type]

        params = [p for p in model.parameters() if p.requires_grad]

        def grad_hook() -> None:
            if self.params.clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(params, self.params.clip_grad)
            for k in ("fn", "vn"):  # the running values carry over to the next step without their graph
                if state.get(k) is not None:
                    state[k] = state[k].detach()

        try:
            terms = self.with_decoupling(model, {"batch_loss": batch_loss, "grad_hook": grad_hook}, client, rnd, seed)
            self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index), **terms)
        finally:
            for h in handles:
                h.remove()
        sd = model.state_dict()
        for k in self.private:
            store[k] = sd[k].detach().clone()
        if self.params.evaluate == "trained":
            for k in self.shared:  # the personal tensors are in the store already (self.private, above)
                store[TRAINED + k] = sd[k].detach().clone()
        return {k: sd[k].detach() for k in self.shared + self.personal}

    # --- the server
    streaming = False

    def aggregate(self, server: State, uploads: list[tuple[Any, State]], rnd: int) -> State:
        if not uploads:
            return server
        server = dict(server)
        for k in self.shared:
            old = server[k]
            stack = torch.stack([up[k] for _, up in uploads])
            if "running_" in k:
                server[k] = stack.float().mean(0).to(old.dtype)
            elif k.endswith("num_batches_tracked"):  # the code sums these, which grows K-fold a round (and overflows);
                server[k] = stack.double().mean(0).round().to(old.dtype)  # unused with BN momentum 0.1: the mean
            else:
                delta = (stack.float() - old.float()).flatten(1)
                norms = delta.norm(dim=1)
                unit = delta / (norms[:, None] + 1e-8)
                lam = torch.from_numpy(min_norm_weights(unit.double().cpu().numpy())).to(unit)
                server[k] = (old.float() + norms.mean() * (lam @ unit).view_as(old)).to(old.dtype)
        for k in self.personal:
            stack = torch.stack([up[k].float() for _, up in uploads]).flatten(1)
            unit = stack / stack.norm(dim=1, keepdim=True).clamp_min(1e-12)
            mix = torch.softmax(unit @ unit.T / self.params.tau, dim=1)
            mixed = mix @ stack
            for i, (c, up) in enumerate(uploads):
                server[f"{PERSONAL}{c.name}::{k}"] = mixed[i].view_as(up[k]).to(up[k].dtype)
        return server

    def eval_download(self, server, client):
        mine = f"{PERSONAL}{client.name}::"  # the shared layers and this site's personalized ones: no other site's
        rest = {k: v for k, v in server.items() if not k.startswith((PERSONAL, START))}
        return {**rest, **{mine + k: v for k, v in self.own_part(server, client).items()}}

    def eval_state(self, server, store, client):
        own = {k: v for k, v in store.items() if not k.startswith(TRAINED)}
        if self.params.evaluate == "trained":
            return {**own, **{k: store[TRAINED + k] for k in self.shared}}
        return {**own, **self.download(server, client, 0)}

    def global_state(self, server):
        return None

    def eval_is_global(self):
        return False

    def resolved(self) -> dict[str, Any]:
        return {**super().resolved(), "personalized_tensors": len(getattr(self, "personal", []))}
