"""F²DC's feature decoupling and calibration (Wang et al., CVPR 2026, Sec. 4.1-4.2) as a model unit any method can
use: F²DC itself, and FedAvg / FPL / FedHEAL / FDSE "+DFD and DFC" of its Table 3, by configuration (a method's
``decouple:`` params).

At each insertion point L_j (after a unit of the backbone, default the last unit of the feature extractor) the
feature map f (C x H x W) goes through

- the Domain Feature Decoupler A_D: an attribution map S = A_D(f) and a Gumbel-concrete mask
  M = sigmoid((log s - log(1 - s) + g_a - g_b) / sigma), s = sigmoid(S) (Eq. 3), element-wise over C x H x W;
  f+ = M * f (domain-robust), f- = (1 - M) * f (domain-related) (Eq. 4);
- the Domain Feature Corrector A_C: f* = f- + (1 - M) * A_C(f-) (Eq. 6);
- f~ = f+ + f* continues to the next unit (Table 7's variants feed f+, f- or f* instead).

The unit keeps, during training, what the loss needs: with l = GAP(.) and the one-layer MLP m (d -> classes),
L_DFD = s(l+, l-) / tau + CE(m(l+), y) + CE(m(l-), y^) (Eq. 5, the separability term log(exp(.)) is linear in the
cosine) and L_DFC = CE(m(l*), y) (Eq. 7); the method adds (1/|L|) sum_j (lambda1 L_DFD + lambda2 L_DFC) to the
cross-entropy (Eq. 9). y^ is the most confident wrong class of the *main* classifier's logits (the authors' code,
``get_pred``; the paper only says "the wrong label with the highest confidence").

Choices where the paper leaves a detail open or its code differs (authors' code github:mala-lab/F2DC, HEAD 7a4f060):

- A_D and A_C are "a two-layer CNN with batch normalization and ReLU" (paper): conv3x3(C -> w), BN, ReLU,
  conv3x3(w -> C), with w = 64 as in the code's first release (which cannot run F²DC: its backbone returns five
  values where the method unpacks seven); the code since commit 6b0a8ed uses three convolutions of width 50
  (``convs: 3, width: 50`` reproduces it).
- Noise: the code draws standard Gumbel noise for g_a and g_b (their difference is logistic); the paper's Eq. 3
  prints g = log u - log(1 - u) (logistic) for each. ``noise: gumbel`` (default, the code) or ``logistic`` (Eq. 3).
- At test time the mask is its noise-free value M = sigmoid(S / sigma) (the code's ``is_eval=True`` branch; its
  evaluation never sets it and so samples a random mask at test time, which makes the reported accuracy random).
- Without the decoupler (Table 6's "w/o DFD") there is no mask: M = 0, f- = f, the corrector calibrates the whole
  feature and only L_DFC is added. Without the corrector ("w/o DFC") f* = f- (A_C = 0): f~ = f+ + f- = f, and only
  L_DFD is added.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from torch import nn

from fedsilo.config import ConfigError, Strict
from fedsilo.models import LayeredNet

FEATURES = ("tilde", "plus", "minus", "star")


class DecouplingParams(Strict):
    """The DFD / DFC modules and their loss weights (F²DC Eq. 3-9)."""

    dfd: bool = Field(True, description="the Domain Feature Decoupler and L_DFD (Table 6's 'w/o DFD' sets false)")
    dfc: bool = Field(True, description="the Domain Feature Corrector and L_DFC (Table 6's 'w/o DFC' sets false)")
    sigma: float = Field(0.1, gt=0, description="Gumbel-concrete temperature of the mask (Eq. 3; Table 5)")
    tau: float = Field(0.06, gt=0, description="separability temperature (Eq. 5)")
    lambda1: float = Field(0.8, ge=0, description="weight of L_DFD (Eq. 9)")
    lambda2: float = Field(1.0, ge=0, description="weight of L_DFC (Eq. 9)")
    width: int = Field(64, ge=1, description="hidden channels of A_D and A_C (the code's first release: 64; since 6b0a8ed: 50)")
    convs: int = Field(2, ge=2, description="convolutions in A_D and A_C (paper: a two-layer CNN; the code since 6b0a8ed: 3)")
    noise: Literal["gumbel", "logistic"] = Field("gumbel", description="noise of g_a, g_b: the code's standard Gumbel or Eq. 3's logistic")
    layers: Optional[tuple[str, ...]] = Field(
        None, description="backbone units after which DFD/DFC are inserted (L_j); default: the last unit of the feature extractor"
    )

    @field_validator("layers", mode="before")
    @classmethod
    def _one_layer(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v  # `layers: layer4` as `layers: [layer4]`
    feature: Literal["tilde", "plus", "minus", "star"] = Field(
        "tilde", description="what continues to the classifier (Table 7): f~ = f+ + f*, f+, f- or f*"
    )
    share_modules: bool = Field(
        False, description="upload and average A_D, A_C and m like the rest of the model (the authors' code) instead of "
        "keeping them on the client (the paper, Sec. 4.3)",
    )

    @model_validator(mode="after")
    def _plus_needs_the_mask(self) -> "DecouplingParams":
        if self.feature == "plus" and not self.dfd:  # no DFD: the mask is 0, f+ = 0 for every image
            raise PydanticCustomError("needs_dfd", "plus (f+ = M * f) needs the decoupler's mask: with dfd: false f+ is zero "
                                      "for every image and the classifier learns nothing (use tilde, minus or star, or dfd: true)",
                                      {"field": "feature"})
        return self


def _conv_stack(channels: int, width: int, convs: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    c_in = channels
    for _ in range(convs - 1):
        layers += [nn.Conv2d(c_in, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        c_in = width
    layers.append(nn.Conv2d(c_in, channels, 3, padding=1, bias=False))
    return nn.Sequential(*layers)


class DecouplingUnit(nn.Module):
    """DFD + DFC + m at one insertion point. Input and output are feature maps B x C x H x W."""

    def __init__(self, channels: int, num_classes: int, p: DecouplingParams):
        super().__init__()
        self.p = p
        self.dfd = _conv_stack(channels, p.width, p.convs) if p.dfd else None
        self.dfc = _conv_stack(channels, p.width, p.convs) if p.dfc else None
        self.m = nn.Linear(channels, num_classes)
        self.generator: Optional[torch.Generator] = None
        self.stash: Optional[dict[str, torch.Tensor]] = None

    def _noise(self, like: torch.Tensor) -> torch.Tensor:
        u = torch.rand(like.shape, generator=self.generator, device=like.device, dtype=torch.float32)
        u = u.clamp(1e-8, 1 - 1e-8)
        if self.p.noise == "gumbel":
            return -torch.log(-torch.log(u))
        return torch.log(u) - torch.log1p(-u)

    def mask(self, f: torch.Tensor) -> torch.Tensor:
        """M of Eq. 3: sampled in training, its noise-free value sigmoid(S / sigma) in evaluation."""
        assert self.dfd is not None
        s = self.dfd(f).float()
        if self.training:
            s = s + self._noise(s) - self._noise(s)
        return torch.sigmoid(s / self.p.sigma).to(f.dtype)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        m = self.mask(f) if self.dfd is not None else torch.zeros_like(f)
        f_plus, f_minus = m * f, (1 - m) * f
        f_star = f_minus + (1 - m) * self.dfc(f_minus) if self.dfc is not None else f_minus
        if self.training:
            pooled = {k: v.mean(dim=(2, 3)) for k, v in (("plus", f_plus), ("minus", f_minus), ("star", f_star))}
            self.stash = {"l_plus": pooled["plus"], "l_minus": pooled["minus"], **{f"logit_{k}": self.m(v) for k, v in pooled.items()}}
        else:
            self.stash = None
        return {"tilde": f_plus + f_star, "plus": f_plus, "minus": f_minus, "star": f_star}[self.p.feature]

    def loss(self, y: torch.Tensor, y_wrong: torch.Tensor) -> torch.Tensor:
        """lambda1 L_DFD + lambda2 L_DFC of the latest training forward (Eq. 5, 7, 9)."""
        if self.stash is None:
            raise RuntimeError("DecouplingUnit.loss: no training forward to take the loss of")
        st, total = self.stash, torch.zeros((), device=y.device)
        if self.dfd is not None:
            sep = F.cosine_similarity(st["l_plus"].float(), st["l_minus"].float(), dim=1, eps=1e-8).mean() / self.p.tau
            dis = F.cross_entropy(st["logit_plus"].float(), y) + F.cross_entropy(st["logit_minus"].float(), y_wrong)
            total = total + self.p.lambda1 * (sep + dis)
        if self.dfc is not None:
            total = total + self.p.lambda2 * F.cross_entropy(st["logit_star"].float(), y)
        return total


def most_confident_wrong(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y^: the class of highest logit other than the true one (no gradient: it is a label)."""
    masked = logits.detach().float().clone()
    masked.scatter_(1, y[:, None], float("-inf"))
    return masked.argmax(1)


def units(model: nn.Module) -> list[DecouplingUnit]:
    return [m for m in model.modules() if isinstance(m, DecouplingUnit)]


def module_keys(model: nn.Module) -> set[str]:
    """state_dict keys of every A_D, A_C and m (what the paper keeps on the client)."""
    prefixes = [name + "." for name, m in model.named_modules() if isinstance(m, DecouplingUnit)]
    return {k for k in model.state_dict() if k.startswith(tuple(prefixes))}


def insert_decoupling(model: LayeredNet, example: torch.Tensor, p: DecouplingParams, key: str = "decouple.layers") -> LayeredNet:
    """A LayeredNet with a DecouplingUnit (weighted-layer count 0) after each unit named in ``p.layers``; ``key``: the
    dotted key of ``layers`` its errors name (``methods.f2dc.layers``, ``methods.fedavg_dc.decouple.layers``)."""
    n_fe = len(model.units) - model.head_units
    names = p.layers or (model.unit_names[n_fe - 1],)
    unknown = [n for n in names if n not in model.unit_names[:n_fe]]
    if unknown:
        raise ConfigError(f"{key}: {unknown} are not units of the feature extractor ({model.unit_names[:n_fe]})")
    was = model.training
    model.eval()
    out: list[tuple[str, nn.Module, int]] = []
    x = example
    with torch.no_grad():
        logits = model(example)
        dims = {}  # each unit's output: DFD and DFC need a feature map (4-d) after the units they follow
        for name, unit, depth in model.layers():
            x = unit(x)
            dims[name] = x.dim()
            out.append((name, unit, depth))
            if name in names and x.dim() == 4:
                out.append((f"decouple@{name}", DecouplingUnit(x.shape[1], logits.shape[1], p), 0))
    model.train(was)
    flat = [n for n in names if dims[n] != 4]
    if flat:
        maps = [n for n in model.unit_names[:n_fe] if dims[n] == 4]
        raise ConfigError(f"{key}: unit {flat[0]!r} gives a {dims[flat[0]]}-d output; DFD/DFC need feature maps"
                          + ("" if p.layers else " (the default is the feature extractor's last unit)")
                          + f": the units of this backbone that give one are {', '.join(maps) or 'none'}")
    net = LayeredNet(out, head_units=model.head_units).to(next(model.parameters()).device)  # the new units too
    net.train(was)
    return net


def decoupling_loss(model: nn.Module, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(1/|L|) sum_j (lambda1 L_DFD^j + lambda2 L_DFC^j) of Eq. 9 for the batch just forwarded."""
    found = units(model)
    y_wrong = most_confident_wrong(logits, y)
    return sum(u.loss(y, y_wrong) for u in found) / len(found)  # type: ignore[return-value]


def seed_noise(model: nn.Module, seed: int, device: torch.device) -> None:
    """Seed the Gumbel noise of every unit (one generator on the training device), so that a round's masks are a
    function of (seed, round, client) and a resumed run draws what an uninterrupted one draws."""
    for i, u in enumerate(units(model)):
        g = torch.Generator(device=device)
        g.manual_seed(int(seed) + i)
        u.generator = g
