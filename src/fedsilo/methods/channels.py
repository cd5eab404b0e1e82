"""Channel partitions: a fraction of every layer's output channels owned by the client, the rest shared (CD2-pFed's
vertical channel decoupling, Shen et al. CVPR 2022, Sec. 3.2).

A layer's output channel c is *private* when c < n_l and *shared* otherwise, with the same rule in every layer, so
that (a) the private set only grows as the ratio grows (a channel never turns back to shared), (b) a ResNet's identity
shortcut adds channel c to channel c of the same owner (a parameter-free shortcut that moves channels, ResNet-32's
zero-padding option A, c -> c + 8, is held to the rule by masking the block's output as well), and (c) the subnets are the width slices of slimmable
networks, whose in-place distillation CD2-pFed's cyclic distillation follows.

Ownership is by output channel, so the private share of the parameters is the ratio: a convolution's or a hidden
linear layer's row ``W[c]`` and ``bias[c]``, and the BatchNorm after it (``weight[c]``, ``bias[c]``,
``running_mean[c]``, ``running_var[c]``), belong to channel c's owner. The classifier's outputs are the classes and
cannot be split; its input columns are split instead (the columns that read the previous layer's private channels
are private) and its bias is shared. BatchNorm's ``num_batches_tracked`` stays on the client.

Subnets: the *private* subnet g_wi computes only private channels from private channels at every layer, the *shared*
subnet g_w0 only shared from shared, the *full* network everything. They run on the same module by zeroing the other
owner's channels after each layer's normalization (masking before BatchNorm would leave its beta), through forward
hooks: the state_dict keys are the engine's. Supported: chains of ``Conv2d`` (groups 1) / ``Linear`` layers with
optional BatchNorm, and ResNets of BasicBlocks; a model with another parameterized module, or a BatchNorm that does
not normalize a single layer's output (DenseNet's concatenations), is refused with the module's name.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from fedsilo.client.local import running_stats_frozen
from fedsilo.methods.base import State

FULL, PRIVATE, SHARED = "full", "private", "shared"
SLICE = "@shared"  # suffix of a payload key holding the shared rows (or columns) of a tensor


@dataclass
class Layer:
    """One decoupled layer: its row-owned state keys, its width, and where its output is masked."""

    name: str
    width: int  # output channels (the classifier: its input features)
    row_keys: list[str]  # state keys sliced along dim 0 by output channel
    column_key: Optional[str] = None  # the classifier's weight, sliced along dim 1
    whole_keys: tuple[str, ...] = ()  # shared whole (the classifier's bias)
    group: int = 1  # classifier input columns per channel of the layer before it
    masked: Optional[nn.Module] = None  # the module whose output is masked (the BatchNorm after the layer, or it)


class ChannelPartition:
    """The decoupled layers of a model in forward order, the private channel count of each at a ratio, the subnet
    masks, and the slicing of a state into its shared part."""

    def __init__(self, model: nn.Module):
        self.model = model
        leaves = [(n, m) for n, m in model.named_modules()
                  if not list(m.children()) and (isinstance(m, nn.modules.batchnorm._BatchNorm) or any(True for _ in m.parameters(recurse=False)))]
        self.layers: list[Layer] = []
        i = 0
        while i < len(leaves):
            name, m = leaves[i]
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                raise ValueError(f"channel decoupling: BatchNorm {name!r} does not normalize the output of the layer before it "
                                 "(pre-activation over concatenated features, as in DenseNet, is not supported)")
            if type(m) not in (nn.Conv2d, nn.Linear) or (isinstance(m, nn.Conv2d) and m.groups != 1):
                raise ValueError(f"channel decoupling: module {name!r} ({type(m).__name__}) is not a plain convolution, "
                                 "linear layer or the BatchNorm after one")
            width = m.out_channels if isinstance(m, nn.Conv2d) else m.out_features
            keys = [f"{name}.weight"] + ([f"{name}.bias"] if m.bias is not None else [])
            masked: nn.Module = m
            if i + 1 < len(leaves) and isinstance(leaves[i + 1][1], nn.modules.batchnorm._BatchNorm):
                bn_name, bn = leaves[i + 1]
                if bn.num_features != width:
                    raise ValueError(f"channel decoupling: BatchNorm {bn_name!r} normalizes {bn.num_features} channels, not the "
                                     f"{width} outputs of {name!r} (concatenated features are not supported)")
                keys += [f"{bn_name}.{k}" for k in ("weight", "bias", "running_mean", "running_var") if getattr(bn, k, None) is not None]
                masked = bn
                i += 1
            self.layers.append(Layer(name, width, keys, masked=masked))
            i += 1
        if len(self.layers) < 2 or not isinstance(leaves[-1][1], nn.Linear):
            raise ValueError("channel decoupling needs a model that ends in a linear classifier after at least one layer")
        name, fc = leaves[-1]
        prev = self.layers[-2].width
        if fc.in_features % prev:
            raise ValueError(f"channel decoupling: classifier {name!r} reads {fc.in_features} features, not a multiple of the "
                             f"{prev} channels before it")
        self.layers[-1] = Layer(name, prev, [], column_key=f"{name}.weight", whole_keys=(f"{name}.bias",) if fc.bias is not None else (),
                                group=fc.in_features // prev)
        self.hidden = self.layers[:-1]  # the layers whose outputs are split
        self.counts: list[int] = [0] * len(self.hidden)
        self.mode = FULL
        for k, layer in enumerate(self.hidden):
            layer.masked.register_forward_hook(self._hook(k))  # type: ignore[union-attr]
        # a residual block's output (after the shortcut is added) is masked like its last convolution's: a no-op
        # where the shortcut keeps each channel's owner, and what keeps the subnets apart where it does not
        # (a torchvision BasicBlock, whose output is its conv2's; a Bottleneck's conv3 and downsample are masked layers)
        from torchvision.models.resnet import BasicBlock

        index = {layer.name: k for k, layer in enumerate(self.hidden)}
        for name, m in model.named_modules():
            if isinstance(m, BasicBlock) and f"{name}.conv2" in index:
                m.register_forward_hook(self._hook(index[f"{name}.conv2"]))
        head = self.layers[-1]
        self.keys = {k for layer in self.hidden for k in layer.row_keys} | {head.column_key, *head.whole_keys}

    # --- ratios and masks
    @staticmethod
    def count(ratio: float, width: int) -> int:
        """Private channels of a layer of ``width`` at ``ratio``: floor(ratio * width) (a small ratio gives none)."""
        return int(math.floor(ratio * width + 1e-9))

    def counts_at(self, ratio: float) -> list[int]:
        return [self.count(ratio, h.width) for h in self.hidden]

    def set_ratio(self, ratio: float) -> list[int]:
        self.counts = self.counts_at(ratio)
        return self.counts

    def subnets_complete(self) -> bool:
        """Both subnets reach the logits: every split layer has a private and a shared channel."""
        return all(0 < n < h.width for n, h in zip(self.counts, self.hidden))

    def _hook(self, k: int):
        def hook(module: nn.Module, inputs, out: torch.Tensor) -> Optional[torch.Tensor]:
            if self.mode == FULL:
                return None
            n = self.counts[k]
            mask = torch.zeros(out.shape[1], device=out.device, dtype=out.dtype)
            if self.mode == PRIVATE:
                mask[:n] = 1
            else:
                mask[n:] = 1
            return out * mask.view(1, -1, *([1] * (out.dim() - 2)))

        return hook

    @contextmanager
    def subnet(self, mode: str) -> Iterator[None]:
        """Forwards inside the block run the private or the shared subnet; the model's BatchNorm running statistics
        are left as the full network's (the network that is evaluated)."""
        before, self.mode = self.mode, mode
        try:  # batch statistics without updating the running ones (in training mode; evaluation reads them)
            with running_stats_frozen(self.model):
                yield
        finally:
            self.mode = before

    # --- slicing
    def _column_start(self, counts: list[int]) -> int:
        return counts[-1] * self.layers[-1].group

    def shared_part(self, state: State, counts: list[int]) -> State:
        """The shared rows (and classifier columns, and whole shared tensors) of ``state`` under ``counts``, keyed
        ``<key>@shared``; views, not copies."""
        out: State = {}
        for n, layer in zip(counts, self.hidden):
            for k in layer.row_keys:
                out[k + SLICE] = state[k][n:]
        head = self.layers[-1]
        out[head.column_key + SLICE] = state[head.column_key][:, self._column_start(counts):]  # type: ignore[index]
        for k in head.whole_keys:
            out[k + SLICE] = state[k]
        return out

    def private_views(self, params: dict[str, torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
        """Views of the private rows / columns of the floating tensors in ``params`` (parameters or their copies)."""
        out = []
        for n, layer in zip(counts, self.hidden):
            out += [params[k][:n] for k in layer.row_keys if k in params]
        head = self.layers[-1]
        if head.column_key in params:
            out.append(params[head.column_key][:, : self._column_start(counts)])
        return [v for v in out if v.numel()]

    def write(self, state: State, payload: State) -> None:
        """Write the ``<key>@shared`` tensors of ``payload`` into the trailing rows (the classifier's weight: its
        trailing columns) of the tensors of ``state``, in place; each slice's offset follows from its size."""
        for key, part in payload.items():
            if not key.endswith(SLICE):
                raise KeyError(f"{key}: not a shared slice")
            key = key[: -len(SLICE)]
            full = state[key]
            if key == self.layers[-1].column_key:
                full[:, full.shape[1] - part.shape[1]:].copy_(part)
            else:
                full[full.shape[0] - part.shape[0]:].copy_(part)

    def private_fraction(self, model: nn.Module, counts: list[int]) -> float:
        """Fraction of the model's parameters that are private under ``counts``."""
        params = dict(model.named_parameters())
        total = sum(p.numel() for p in params.values())
        return sum(v.numel() for v in self.private_views({k: p.detach() for k, p in params.items()}, counts)) / max(total, 1)
