"""Backbones as ordered lists of layer units.

Every model is a :class:`LayeredNet`: an ``nn.ModuleList`` of units run in order, each unit holding one or more
*weighted layers* (convolutions and linear layers, with their BatchNorm / activation / pooling). ``depths[i]`` is
the number of weighted layers in unit i, so the paper-style layer count of a prefix is a running sum: DenseNet-121
has 121 (stem conv, 58 dense layers of two convs, 3 transition convs, the classifier), ResNet-18 has 18, ResNet-10
has 10, FedBN's AlexNet has 8, FedBN's digit CNN ("Simple-CNN") has 6.

``feature_extractor()`` is every unit before the head, ``head()`` the last unit (the classifier), ``cut(l)`` splits
after the first ``l`` weighted layers (pFedDB's cut depth) and refuses a depth that falls inside a unit.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Sequence

import torch
from torch import nn

from fedsilo.config import WIDTH_SCALED, ConfigError, min_image_size


class LayeredNet(nn.Module):
    def __init__(self, units: Sequence[tuple[str, nn.Module, int]], head_units: int = 1):
        super().__init__()
        self.units = nn.ModuleList([m for _, m, _ in units])
        self.unit_names = [n for n, _, _ in units]
        self.depths = [d for _, _, d in units]
        if not 1 <= head_units < len(self.units):
            raise ValueError("head_units must leave at least one unit in the feature extractor")
        self.head_units = head_units

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for u in self.units:
            x = u(x)
        return x

    @property
    def num_layers(self) -> int:
        return sum(self.depths)

    def feature_extractor(self) -> nn.Sequential:
        return nn.Sequential(*self.units[: len(self.units) - self.head_units])

    def head(self) -> nn.Sequential:
        return nn.Sequential(*self.units[len(self.units) - self.head_units :])

    def layers(self) -> list[tuple[str, nn.Module, int]]:
        """Ordered (name, module, weighted-layer count) units."""
        return list(zip(self.unit_names, self.units, self.depths))

    def cut_index(self, depth: int) -> int:
        """Number of units whose weighted layers add up to ``depth``."""
        if not 1 <= depth <= self.num_layers:
            raise ValueError(f"cut depth {depth} outside 1..{self.num_layers}")
        total = 0
        for i, d in enumerate(self.depths):
            total += d
            if total == depth:
                return i + 1
            if total > depth:
                raise ValueError(
                    f"cut depth {depth} falls inside unit {self.unit_names[i]!r} "
                    f"(layers {total - d + 1}..{total}); choose a unit boundary"
                )
        raise AssertionError("unreachable")

    def cut(self, depth: int) -> tuple[nn.Sequential, nn.Sequential]:
        k = self.cut_index(depth)
        return nn.Sequential(*self.units[:k]), nn.Sequential(*self.units[k:])


def simple_cnn(in_channels: int, num_classes: int, width: float = 1.0) -> LayeredNet:
    """FedBN's digit model (Li et al. 2021, ``DigitModel``): three 5x5 convs (64, 64, 128) with BN, ReLU and max
    pooling after the first two, then FC 2048 -> 512 -> classes with BN. An adaptive average pool to 7x7 before
    the first FC keeps the model exactly FedBN's at 28 px and lets it take other image sizes.

    ``width`` (``train.model_width``) scales every conv's channels and hidden FC's units (rounded, at least 1):
    1.0 is FedBN's model (14.2 M weights for 3-channel images and 10 classes); 0.25 keeps its units, layers and BatchNorm sets with 16x
    fewer weights (the first FC holds most of them): a CPU quickstart or test that checks a pipeline, not a paper."""

    def w(n: int) -> int:
        return max(1, int(round(n * width)))

    def conv(cin: int, cout: int, pool: bool) -> nn.Sequential:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, 5, 1, 2), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
        if pool:
            layers.append(nn.MaxPool2d(2))
        return nn.Sequential(*layers)

    return LayeredNet(
        [
            ("conv1", conv(in_channels, w(64), True), 1),
            ("conv2", conv(w(64), w(64), True), 1),
            ("conv3", nn.Sequential(*conv(w(64), w(128), False), nn.AdaptiveAvgPool2d(7), nn.Flatten()), 1),
            ("fc1", nn.Sequential(nn.Linear(w(128) * 7 * 7, w(2048)), nn.BatchNorm1d(w(2048)), nn.ReLU(inplace=True)), 1),
            ("fc2", nn.Sequential(nn.Linear(w(2048), w(512)), nn.BatchNorm1d(w(512)), nn.ReLU(inplace=True)), 1),
            ("fc3", nn.Linear(w(512), num_classes), 1),
        ]
    )


def alexnet_bn(in_channels: int, num_classes: int) -> LayeredNet:
    """AlexNet with BatchNorm after every conv and hidden FC, as FedBN uses it for Office-Caltech-10 / DomainNet."""

    def conv(cin: int, cout: int, k: int, s: int, p: int, pool: bool, tail: Sequence[nn.Module] = ()) -> nn.Sequential:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, s, p), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
        if pool:
            layers.append(nn.MaxPool2d(3, 2))
        return nn.Sequential(*layers, *tail)

    def fc(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Linear(cin, cout), nn.BatchNorm1d(cout), nn.ReLU(inplace=True))

    return LayeredNet(
        [
            ("conv1", conv(in_channels, 64, 11, 4, 2, True), 1),
            ("conv2", conv(64, 192, 5, 1, 2, True), 1),
            ("conv3", conv(192, 384, 3, 1, 1, False), 1),
            ("conv4", conv(384, 256, 3, 1, 1, False), 1),
            ("conv5", conv(256, 256, 3, 1, 1, True, (nn.AdaptiveAvgPool2d(6), nn.Flatten())), 1),
            ("fc1", fc(256 * 6 * 6, 4096), 1),
            ("fc2", fc(4096, 4096), 1),
            ("fc3", nn.Linear(4096, num_classes), 1),
        ]
    )


class _DenseUnit(nn.Module):
    """One torchvision ``_DenseLayer`` as a tensor -> tensor unit: concatenates its new features to its input,
    which is what ``_DenseBlock`` does across its layers."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.layer(x)], 1)


def densenet121(in_channels: int, num_classes: int) -> LayeredNet:
    """torchvision's DenseNet-121 (random init; no weights are downloaded), unrolled into 121 counted layers."""
    from torchvision.models import densenet121 as tv_densenet121

    net = tv_densenet121(weights=None, num_classes=num_classes)
    f = net.features
    if in_channels != 3:
        f.conv0 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    units: list[tuple[str, nn.Module, int]] = [("stem", nn.Sequential(f.conv0, f.norm0, f.relu0, f.pool0), 1)]
    for b in range(1, 5):
        block = getattr(f, f"denseblock{b}")
        for name, layer in block.items():
            units.append((f"denseblock{b}.{name}", _DenseUnit(layer), 2))
        if b < 4:
            units.append((f"transition{b}", getattr(f, f"transition{b}"), 1))
    units.append(
        ("classifier", nn.Sequential(f.norm5, nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), net.classifier), 1)
    )
    return LayeredNet(units)


def _resnet(blocks: list[int], in_channels: int, num_classes: int, small_stem: bool = False) -> LayeredNet:
    from torchvision.models.resnet import BasicBlock, ResNet

    net = ResNet(BasicBlock, blocks, num_classes=num_classes)
    if small_stem:  # 3x3 stride-1 convolution, no max-pool: the CIFAR-style stem for 32-128 px images
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        stem = nn.Sequential(net.conv1, net.bn1, net.relu)
    else:
        if in_channels != 3:
            net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
    units: list[tuple[str, nn.Module, int]] = [("stem", stem, 1)]
    for s in range(1, 5):
        for i, block in enumerate(getattr(net, f"layer{s}")):
            units.append((f"layer{s}.{i}", block, 2))
    units.append(("fc", nn.Sequential(net.avgpool, nn.Flatten(), net.fc), 1))
    return LayeredNet(units)


def resnet10(in_channels: int, num_classes: int) -> LayeredNet:
    """ResNet-10: torchvision's ResNet (7x7 stride-2 stem, max-pool) with one BasicBlock per stage."""
    return _resnet([1, 1, 1, 1], in_channels, num_classes)


def resnet10_cifar(in_channels: int, num_classes: int) -> LayeredNet:
    """ResNet-10 as F²DC's, MOON's and FPL's code build it: one BasicBlock per stage (64, 128, 256, 512 channels, d =
    512) after a 3x3 stride-1 stem without max-pool, so the last stage's map is 1/8 of the image (4x4 at 32 px,
    16x16 at 128 px: the 512 x 16 x 16 of F²DC's PACS).

    Initialisation as F²DC's backbones have it (``backbone/ResNet.py``, ``ResNet_DC.py``: no init code of their own):
    every convolution keeps PyTorch's default (Kaiming-uniform with a = sqrt(5), weight std 1 / sqrt(3 fan_in)), not
    torchvision's Kaiming-normal (fan_out) of its ResNet, which starts the weights about 2.5x larger; BatchNorm (1, 0)
    and the classifier are the same in both."""
    net = _resnet([1, 1, 1, 1], in_channels, num_classes, small_stem=True)
    for module in net.modules():
        if isinstance(module, nn.Conv2d):
            module.reset_parameters()
    return net


def resnet18(in_channels: int, num_classes: int) -> LayeredNet:
    return _resnet([2, 2, 2, 2], in_channels, num_classes)


def resnet34(in_channels: int, num_classes: int) -> LayeredNet:
    """ResNet-34 (He et al. 2016): torchvision's, BasicBlocks [3, 4, 6, 3] (CD2-pFed's CIFAR-100 and FLICKR-AES
    backbone)."""
    return _resnet([3, 4, 6, 3], in_channels, num_classes)


def resnet34_cifar(in_channels: int, num_classes: int) -> LayeredNet:
    """ResNet-34 with the CIFAR-style stem (3x3 stride-1 convolution, no max-pool) in place of torchvision's 7x7
    stride-2 convolution and max-pool, which shrink a 32 px image to 8x8 before the first stage (1x1 at the last): the
    other reading of CD2-pFed's "ResNet-34" on 32 px CIFAR-100, whose preset keeps torchvision's."""
    return _resnet([3, 4, 6, 3], in_channels, num_classes, small_stem=True)


class _PadShortcut(nn.Module):
    """He et al. 2016's option A shortcut for CIFAR ResNets: the identity, spatially subsampled by 2, the new channels
    zero (no parameters)."""

    def __init__(self, extra: int):
        super().__init__()
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, ::2, ::2]
        return nn.functional.pad(x, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))


def resnet32(in_channels: int, num_classes: int) -> LayeredNet:
    """ResNet-32 (He et al. 2016, Sec. 4.2, the CIFAR ResNets: 6n + 2 layers, n = 5): a 3x3 convolution with 16 filters,
    three stages of five BasicBlocks with 16, 32 and 64 filters (the first block of stages 2 and 3 with stride 2 and the
    paper's parameter-free option-A shortcut), global average pooling and the classifier: 0.46 M parameters on 10
    classes (CD2-pFed's HISTO-FED backbone)."""
    from torchvision.models.resnet import BasicBlock

    stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
    units: list[tuple[str, nn.Module, int]] = [("stem", stem, 1)]
    width = 16
    for s, planes in enumerate((16, 32, 64), start=1):
        for i in range(5):
            stride = 2 if s > 1 and i == 0 else 1
            short = _PadShortcut(planes - width) if stride == 2 else None
            units.append((f"layer{s}.{i}", BasicBlock(width, planes, stride=stride, downsample=short), 2))
            width = planes
    units.append(("fc", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)), 1))
    return LayeredNet(units)


def _flat_size(convs: nn.Module, in_channels: int, image_size: int) -> int:
    with torch.no_grad():
        return int(convs(torch.zeros(1, in_channels, image_size, image_size)).flatten(1).shape[1])


def lenet5(in_channels: int, num_classes: int, image_size: int = 32) -> LayeredNet:
    """LeNet-5 (LeCun et al. 1998) as federated-learning papers run it on CIFAR-10 (CD2-pFed's backbone): conv 5x5 6,
    max-pool, conv 5x5 16, max-pool, FC 120, FC 84, FC classes, ReLU; 5 weighted layers (62 k parameters at 32 px)."""
    c1 = nn.Sequential(nn.Conv2d(in_channels, 6, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2))
    c2 = nn.Sequential(nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten())
    flat = _flat_size(nn.Sequential(c1, c2), in_channels, image_size)
    return LayeredNet([
        ("conv1", c1, 1),
        ("conv2", c2, 1),
        ("fc1", nn.Sequential(nn.Linear(flat, 120), nn.ReLU(inplace=True)), 1),
        ("fc2", nn.Sequential(nn.Linear(120, 84), nn.ReLU(inplace=True)), 1),
        ("fc3", nn.Linear(84, num_classes), 1),
    ])


def _leaky_cnn(convs: Sequence[tuple[int, int, int]], in_channels: int, num_classes: int, image_size: int) -> LayeredNet:
    """FedPAC's CNN family: conv units (out channels, kernel, padding), each with LeakyReLU and 2x2 max-pooling, then
    FC 128 with LeakyReLU (the feature, d = 128) and FC classes (the classifier)."""
    units: list[tuple[str, nn.Module, int]] = []
    cin = in_channels
    for i, (cout, k, pad) in enumerate(convs, 1):
        units.append((f"conv{i}", nn.Sequential(nn.Conv2d(cin, cout, k, padding=pad), nn.LeakyReLU(inplace=True), nn.MaxPool2d(2)), 1))
        cin = cout
    name, last, depth = units[-1]
    units[-1] = (name, nn.Sequential(*last, nn.Flatten()), depth)
    flat = _flat_size(nn.Sequential(*[u for _, u, _ in units]), in_channels, image_size)
    return LayeredNet(units + [("fc1", nn.Sequential(nn.Linear(flat, 128), nn.LeakyReLU(inplace=True)), 1), ("fc2", nn.Linear(128, num_classes), 1)])


def fedecouple_cnn(in_channels: int, num_classes: int, image_size: int = 32) -> LayeredNet:
    """FedeCouple's CNN (Sec. V-A2; the layer shapes of FedPAC's ``CifarCNN``, which its authors' earlier code uses):
    conv 5x5 16 (no padding), conv 5x5 32 (padding 1), conv 3x3 64 (padding 1), each with LeakyReLU and 2x2
    max-pooling, FC 128 with LeakyReLU (the feature, d = 128), FC classes (the classifier). At 32 px the extractor has
    106,400 parameters, 415.6 KB: FedeCouple's Table VII."""
    return _leaky_cnn([(16, 5, 0), (32, 5, 1), (64, 3, 1)], in_channels, num_classes, image_size)


def fedecouple_cnn_gray(in_channels: int, num_classes: int, image_size: int = 28) -> LayeredNet:
    """FedeCouple's Fashion-MNIST / EMNIST variant (FedPAC's ``CNN_FMNIST`` shapes): conv 5x5 16 (no padding), conv
    5x5 32 (padding 1), each with LeakyReLU and 2x2 max-pooling, FC 128 with LeakyReLU, FC classes; at 28 px the
    extractor has 115,776 parameters."""
    return _leaky_cnn([(16, 5, 0), (32, 5, 1)], in_channels, num_classes, image_size)


class _PatchEmbedding(nn.Module):
    """ViT stem: non-overlapping patches projected to tokens, a class token, learned position embeddings (bicubically
    resized when the input's patch grid differs from the one the model was built for)."""

    def __init__(self, in_channels: int, dim: int, patch: int, grid: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, grid * grid + 1, dim).normal_(std=0.02))
        self.grid = grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        h, w = z.shape[-2:]
        z = z.flatten(2).transpose(1, 2)
        pos = self.pos_embedding
        if (h, w) != (self.grid, self.grid):
            d = pos.shape[-1]
            grid = pos[:, 1:].reshape(1, self.grid, self.grid, d).permute(0, 3, 1, 2)
            grid = nn.functional.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
            pos = torch.cat([pos[:, :1], grid.flatten(2).transpose(1, 2)], 1)
        return torch.cat([self.cls_token.expand(z.shape[0], -1, -1), z], 1) + pos


class _ClassTokenHead(nn.Module):
    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)[:, 0])


def vit_tiny(in_channels: int, num_classes: int, image_size: int = 32) -> LayeredNet:
    """A small ViT (DeiT-Ti's shape: 12 pre-norm blocks of torchvision's ``EncoderBlock``, width 192, 3 heads, MLP
    768; 5.5 M parameters) for pFedDB's l_c in {3, 6, 9, 12}. Layers are counted in transformer blocks: the patch
    embedding is layer 0, block i is layer i, the class-token head layer 13. Patches are 16 px from 128 px inputs
    up (224 px: a 14 x 14 grid) and 4 px below (28-32 px: 7 x 7 or 8 x 8)."""
    from torchvision.models.vision_transformer import EncoderBlock

    dim, heads, mlp, depth = 192, 3, 768, 12
    patch = 16 if image_size >= 128 else 4
    grid = max(1, image_size // patch)
    units: list[tuple[str, nn.Module, int]] = [("patch_embedding", _PatchEmbedding(in_channels, dim, patch, grid), 0)]
    for i in range(depth):
        units.append((f"block{i + 1}", EncoderBlock(heads, dim, mlp, 0.0, 0.0), 1))
    units.append(("head", _ClassTokenHead(dim, num_classes), 1))
    return LayeredNet(units)


MODELS: dict[str, Callable[[int, int], LayeredNet]] = {
    "simple_cnn": simple_cnn,
    "alexnet_bn": alexnet_bn,
    "densenet121": densenet121,
    "resnet10_cifar": resnet10_cifar,
    "resnet10": resnet10,
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet34_cifar": resnet34_cifar,
    "resnet32": resnet32,
    "lenet5": lenet5,
    "fedecouple_cnn": fedecouple_cnn,
    "fedecouple_cnn_gray": fedecouple_cnn_gray,
    "vit_tiny": vit_tiny,
}
# models whose parameters depend on the input size (the ViT's patch grid, the CNNs' flattened feature map)
SIZED = {"vit_tiny", "lenet5", "fedecouple_cnn", "fedecouple_cnn_gray"}


def build_model(name: str, in_channels: int, num_classes: int, seed: int | None = None, image_size: int | None = None,
                width: float = 1.0) -> LayeredNet:
    """The backbone ``name``; ``image_size`` (the harmonized images' side) is used by the models that need it;
    ``width`` (``train.model_width``) by the models of :data:`WIDTH_SCALED`."""
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    if width != 1.0 and name not in WIDTH_SCALED:
        raise ConfigError(f"train.model_width: {width}, but {name} is built at its paper's width only (model_width "
                          f"applies to {', '.join(sorted(WIDTH_SCALED))}); set it to 1.0")
    if image_size is not None and image_size < min_image_size(name):
        raise ConfigError(
            f"model {name} needs images of at least {min_image_size(name)} px, these are {image_size} px: raise the "
            f"dataset's image_size (datasets.<dataset>.image_size) or choose another experiments.<experiment>.train.model"
        )
    if seed is not None:
        torch.manual_seed(seed)
    if name in SIZED:
        if image_size is None:
            raise ValueError(f"model {name!r} needs the image size")
        return MODELS[name](in_channels, num_classes, image_size=image_size)  # type: ignore[call-arg]
    if name in WIDTH_SCALED:
        return MODELS[name](in_channels, num_classes, width=width)  # type: ignore[call-arg]
    return MODELS[name](in_channels, num_classes)


RELU_GAIN = math.sqrt(2.0 / (1.0 - 1.0 / math.pi))  # Brock et al. 2021a: the gain that keeps ReLU activations unit-variance


class WSConv2d(nn.Conv2d):
    """Convolution with Scaled Weight Standardization (Brock, De & Smith 2021, used by FedWon's Eq. 1):
    W_hat[i] = gain[i] * gamma * (W[i] - mean(W[i])) / (std(W[i]) * sqrt(N)), N the fan-in of output channel i,
    gamma the activation's gain (ReLU by default) and ``gain`` a learnable per-channel scale starting at 1. The
    standardization is applied on every forward, so the stored ``weight`` stays the raw parameter."""

    def __init__(self, *args, gamma: float = RELU_GAIN, eps: float = 1e-4, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1, device=self.weight.device))
        self.gamma, self.eps = float(gamma), float(eps)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, **kw) -> "WSConv2d":
        ws = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
            dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None, padding_mode=conv.padding_mode,
            # shapes only on the meta device (check-params builds a method's model there); else on the CPU, whose
            # random generator draws the throwaway initialisation on a GPU run too, then moved
            **({"device": "meta"} if conv.weight.is_meta else {}), **kw,
        )
        if conv.weight.is_meta:
            return ws
        with torch.no_grad():
            ws.weight.copy_(conv.weight)
            if conv.bias is not None:
                ws.bias.copy_(conv.bias)  # type: ignore[union-attr]
        return ws.to(conv.weight.device)

    def standardized_weight(self) -> torch.Tensor:
        w = self.weight
        fan_in = w[0].numel()
        var, mean = torch.var_mean(w, dim=(1, 2, 3), keepdim=True, unbiased=False)
        # Brock et al.'s reference form: the floor applies to var * fan_in, so it only guards against dead filters
        return (w - mean) * torch.rsqrt(torch.clamp(var * fan_in, min=self.eps)) * (self.gain * self.gamma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.standardized_weight(), self.bias)


def normalization_free(model: nn.Module) -> nn.Module:
    """A copy of ``model`` without normalization (FedWon): every BatchNorm becomes an identity and every plain
    convolution a :class:`WSConv2d` holding the same weights. Linear layers are kept as they are."""
    out = copy.deepcopy(model)

    def swap(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                setattr(module, name, nn.Identity())
            elif type(child) is nn.Conv2d:
                setattr(module, name, WSConv2d.from_conv(child))
            else:
                swap(child)

    swap(out)
    return out


def batchnorm_keys(model: nn.Module) -> set[str]:
    """state_dict keys (parameters and buffers) that belong to BatchNorm layers."""
    keys: set[str] = set()
    for mname, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            for k in m.state_dict().keys():
                keys.add(f"{mname}.{k}" if mname else k)
    return keys
