"""pFedDB's dual-branch model (paper Eq. 2-4): shared extractor f_s, private extractor f_p, fusion, private head g_p.

The first ``l_c`` weighted layers of the backbone are cloned into f_s(.; phi) and f_p(.; psi_c); the remaining layers
form g_p(.; omega_c); the prediction is g_p(fuse(f_s(x), f_p(x))). ``fusion``: ``add`` (the paper's Eq. 3),
``concat`` (concatenate along channels, then a 1x1 conv / linear back to the original width), ``attention`` (a sigmoid
gate computed from both features mixes them: g * z_s + (1 - g) * z_p), ``weighted`` (alpha * z_s + (1 - alpha) * z_p,
alpha fixed). The fusion layer belongs to the client's private parameters.

f_s and f_p start as copies of one draw of the backbone (``same``), or f_s is taken from a second, independently
drawn backbone (``shared_from``): the authors' model classes build the two branches as separate modules, each
initialised on its own (``nets/models.py``, ``AlexNet_DB``, ``DenseNet_DB``, ``PLENet_DenseNet_ShareCNN``, dev
branch of github.com/yiranpang/pFedDB).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from fedsilo.models import LayeredNet

SHARED, PRIVATE = "shared.", "private."


class Fusion(nn.Module):
    def __init__(self, kind: str, example: torch.Tensor, alpha: float):
        super().__init__()
        self.kind = kind
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        # channels are dim 1 of feature maps (B, C, H, W) and vectors (B, C), the last dim of ViT tokens (B, T, D)
        self.dim = -1 if example.dim() == 3 else 1
        if kind in ("concat", "attention"):
            c = example.shape[self.dim]
            self.proj = nn.Conv2d(2 * c, c, 1) if example.dim() == 4 else nn.Linear(2 * c, c)

    def forward(self, zs: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
        if self.kind == "add":
            return zs + zp
        if self.kind == "weighted":
            return self.alpha * zs + (1 - self.alpha) * zp
        both = torch.cat([zs, zp], self.dim)
        if self.kind == "concat":
            return self.proj(both)
        gate = torch.sigmoid(self.proj(both))
        return gate * zs + (1 - gate) * zp


class DualBranch(nn.Module):
    """shared (f_s), private (f_p), fusion, head (g_p). ``phase = 1`` runs the single-branch model g_p(f_p(x))."""

    def __init__(
        self,
        base: LayeredNet,
        cut_units: int,
        fusion: str,
        alpha: float,
        example: torch.Tensor,
        shared_from: Optional[LayeredNet] = None,
    ):
        """``shared_from``: a backbone of the same architecture whose first ``cut_units`` units become f_s (an
        independent initialisation); by default f_s is a copy of f_p."""
        super().__init__()
        extractor = nn.Sequential(*base.units[:cut_units])
        self.shared = copy.deepcopy(nn.Sequential(*shared_from.units[:cut_units]) if shared_from is not None else extractor)
        self.private = copy.deepcopy(extractor)
        if [(k, v.shape) for k, v in self.shared.state_dict().items()] != [(k, v.shape) for k, v in self.private.state_dict().items()]:
            raise ValueError("shared_from: its first units differ from the backbone's (not the same architecture)")
        self.head = copy.deepcopy(nn.Sequential(*base.units[cut_units:]))
        was = self.private.training
        self.private.eval()  # probe the feature shape without touching BatchNorm statistics
        with torch.no_grad():
            z = self.private(example)
        self.private.train(was)
        self.fusion = Fusion(fusion, z, alpha)
        self.phase = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        zp = self.private(x)
        if self.phase == 1:
            return self.head(zp)
        return self.head(self.fusion(self.shared(x), zp))


def authors_init(net: nn.Module, gen: torch.Generator, conv_mode: str) -> None:
    """The initialisation the authors' dual-branch classes give themselves (``_init_weights`` of ``DigitModel_DB``,
    ``AlexNet_DB``, ``DenseNet_DB`` in ``nets/models.py``, dev branch of github.com/yiranpang/pFedDB): every
    convolution Kaiming normal with ReLU's gain (``conv_mode``: fan_out for the Digits and AlexNet classes, fan_in for
    DenseNet's), every linear layer N(0, 0.01), their biases 0; every BatchNorm weight 1 and bias 0 (running
    statistics untouched). One generator draws module after module in ``net.modules()`` order (f_s, f_p, g_p, then
    the fusion's projection where it has one), so the two branches are independent draws; each draw is made on the
    CPU and copied, so a seed gives the same weights on any device. (``DigitModel_DB`` ties its two convolutional
    branches, one module; here they are two, as in the AlexNet and DenseNet classes.)"""
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                w = torch.empty(m.weight.shape, dtype=torch.float32)
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(w, mode=conv_mode, nonlinearity="relu", generator=gen)
                else:
                    nn.init.normal_(w, 0.0, 0.01, generator=gen)
                m.weight.copy_(w)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
                m.weight.fill_(1.0)
                m.bias.zero_()


def closest_to_70(base: LayeredNet) -> int:
    sizes = [sum(p.numel() for p in u.parameters()) for u in base.units]
    total = sum(sizes)
    best, best_gap, acc, depth = 1, 2.0, 0, 0
    for i, (s, d) in enumerate(zip(sizes, base.depths)):
        acc += s
        depth += d
        if i < len(sizes) - 1 and abs(acc / total - 0.7) < best_gap:
            best, best_gap = depth, abs(acc / total - 0.7)
    return best


def shared_fraction(base: LayeredNet, depth: int) -> float:
    """Fraction of the backbone's parameters in its first ``depth`` weighted layers (Table 3's Ratio)."""
    k = base.cut_index(depth)
    sizes = [sum(p.numel() for p in u.parameters()) for u in base.units]
    return sum(sizes[:k]) / sum(sizes)


def shared_batchnorm_keys(model: nn.Module) -> tuple[set[str], set[str]]:
    """The shared branch's BatchNorm tensors, found by module type (any naming: Simple-CNN's Sequential indices,
    DenseNet's ``norm0`` / ``norm1`` / ``norm2`` / transition ``norm``): (affine weight and bias, running
    statistics and batch counter)."""
    affine: set[str] = set()
    stats: set[str] = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (name + ".").startswith(SHARED):
            affine.update(f"{name}.{k}" for k, _ in m.named_parameters(recurse=False))
            stats.update(f"{name}.{k}" for k, _ in m.named_buffers(recurse=False))
    return affine, stats


def local_branch_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The single-branch model g_p(f_p(x)) that Phase 1 trains: the private extractor and the head."""
    return [p for n, p in model.named_parameters() if n.startswith((PRIVATE, "head."))]


def psi_as_phi(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The private extractor psi under the shared extractor's names: a client's clone of psi_c* into its shared
    branch at the end of Phase 1 (Eq. 6's input)."""
    return {SHARED + k[len(PRIVATE):]: v for k, v in state.items() if k.startswith(PRIVATE)}
