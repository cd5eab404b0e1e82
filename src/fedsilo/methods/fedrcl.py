"""FedRCL: federated relaxed contrastive learning (Seo, Kim, Kim et al., CVPR 2024)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsilo.client.local import make_generator, train_local
from fedsilo.config import ConfigError
from fedsilo.methods.base import MethodParams
from fedsilo.methods.sharing import PartialSharing
from fedsilo.models import LayeredNet


class FedRCLParams(MethodParams):
    temperature: float = Field(0.05, gt=0, description="tau of both contrastive terms")
    threshold: float = Field(0.7, ge=-1, le=1, description="a same-class pair this similar is pushed apart (the relaxation)")
    scl_weight: float = Field(1.0, ge=0, description="weight of the supervised contrastive term")
    penalty_weight: float = Field(1.0, ge=0, description="weight of the divergence penalty (beta)")
    top_negatives: int = Field(2, ge=1, description="hardest other-class samples per anchor (the code's topk_neg)")
    clip_grad: Optional[float] = Field(10.0, gt=0, description="gradient-norm clipping of every local step (the code's "
                                       "clip_grad_norm_ at 10; null: none)")


def scl_loss(z: torch.Tensor, y: torch.Tensor, tau: float, top_negatives: int) -> torch.Tensor:
    """The code's supervised term: per sample, the least similar same-class sample (itself included) against the
    ``top_negatives`` most similar other-class samples of the batch; mean over the batch. z is L2-normalized."""
    s = z @ z.T
    same = y[:, None] == y[None, :]
    pos = s.masked_fill(~same, float("inf")).min(1).values
    k = min(top_negatives, len(y))
    neg = s.masked_fill(same, float("-inf")).topk(k, dim=1).values
    logits = torch.cat([pos[:, None], neg], 1) / tau
    loss = torch.logsumexp(logits, 1) - logits[:, 0]
    return loss.mean()


def divergence_penalty(z: torch.Tensor, y: torch.Tensor, tau: float, threshold: float) -> torch.Tensor:
    """The code's relaxation: the least similar *other* same-class sample, when its similarity is at least the
    threshold, competes with the sample itself (similarity 1); otherwise a constant -1 takes its place."""
    s = z @ z.T
    n = len(y)
    others = (y[:, None] == y[None, :]) & ~torch.eye(n, dtype=torch.bool, device=y.device)
    far = s.masked_fill(~others, float("inf")).min(1).values
    active = others.any(1) & (far >= threshold)
    far = torch.where(active, far, torch.full_like(far, -1.0))
    logits = torch.stack([torch.ones_like(far), far], 1) / tau
    return (torch.logsumexp(logits, 1) - logits[:, 0]).mean()


def hook_levels(model: nn.Module, found: dict[int, torch.Tensor], key: str) -> list:
    """Hooks that put, during the model's own forward, FedRCL's five representations of a ResNet into ``found``:
    the stem's BatchNorm output (0) and each stage's output (1-4), all before their ReLU. Returns the handles."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    if not isinstance(model, LayeredNet) or not any(n.startswith("layer4.") for n in model.unit_names):
        raise ConfigError(f"methods.{key}: FedRCL's multi-level contrast needs a ResNet backbone (resnet10, resnet10_cifar, resnet18)")
    stem_bn = next(m for m in model.units[0].modules() if isinstance(m, nn.BatchNorm2d))
    # clones: the ReLUs that follow work in place and would overwrite what was captured
    handles = [stem_bn.register_forward_hook(lambda _m, _i, out: found.__setitem__(0, out.clone()))]
    last = {int(n[5]): u for n, u in zip(model.unit_names, model.units) if n.startswith("layer") and isinstance(u, (BasicBlock, Bottleneck))}
    for stage, block in last.items():
        def pre(_m: nn.Module, inputs: tuple[torch.Tensor, ...], stage: int = stage) -> None:
            found[stage] = inputs[0].clone()  # the block's ReLU runs twice; the last call's input is the stage output

        handles.append(block.relu.register_forward_pre_hook(pre))
    return handles


def pooled_levels(found: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    return [F.normalize(F.adaptive_avg_pool2d(found[k], 1).flatten(1).float(), dim=1) for k in sorted(found)]


class FedRCL(PartialSharing):
    """Seo et al. 2024 (CVPR), as the authors' code computes its loss (github:skynbe/FedRCL, ``CLLoss`` and
    ``configs/client/fedrcl.yaml``): a client downloads the global model and trains on CE + L_SCL + beta L_pen,
    each averaged over five levels of representation (the stem's BatchNorm output and the four stage outputs of the
    ResNet, before their ReLU, average-pooled and L2-normalized) and over the batch, the contrast taken within the
    batch: L_SCL takes per sample its least similar same-class sample as the positive against its two most similar
    other-class samples (tau = 0.05); the relaxation L_pen lets the least similar other same-class sample compete
    with the sample itself when their similarity is at least 0.7. It uploads the whole model; clients are
    evaluated with the global model.

    Each local step clips the gradient's norm at 10, as the code does (``clip_grad``; at the start the contrastive
    terms, about 10 a level at tau = 0.05, make the first steps large).

    Where we differ from the code: the server takes FedAvg's sample-size-weighted mean (the code averages uniformly;
    F²DC's comparison weights by size), and the optimizer is the preset's (the code: SGD lr 0.1 without momentum,
    weight decay 1e-3, a 0.998 learning-rate decay per round and again per local epoch; its
    per-round decay is ``train.lr_schedule: {kind: exponential, gamma: 0.998}``, the per-epoch one has no setting), and
    the backbone's normalization is the preset's BatchNorm (the code builds its ResNet-18 with GroupNorm(2, C), so its
    level 0 is a GroupNorm output; a pooled BatchNorm output is centred per channel over the batch).
    The paper writes its terms over all
    positives and all pairs above the threshold; the code's hardest-pair form is what was run."""

    name = "fedrcl"
    joinable = True  # one global model: a site may join mid-run
    params_cls = FedRCLParams
    params: FedRCLParams

    def shared_keys(self, model: LayeredNet) -> list[str]:
        return list(model.state_dict().keys())

    def local_update(self, model, store, payload, client, rnd, seed):
        self.load_round(model, store, payload)
        p = self.params
        found: dict[int, torch.Tensor] = {}
        handles = hook_levels(model, found, self.key)

        def batch_loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            zs = pooled_levels(found)
            scl = sum(scl_loss(z, y, p.temperature, p.top_negatives) for z in zs) / len(zs)
            pen = sum(divergence_penalty(z, y, p.temperature, p.threshold) for z in zs) / len(zs)
            return p.scl_weight * scl + p.penalty_weight * pen

        params = [q for q in model.parameters() if q.requires_grad]

        def grad_hook() -> None:  # every parameter's gradient, the code's clip_grad_norm_(model.parameters(), 10)
            if p.clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(params, p.clip_grad)

        try:
            terms = self.with_decoupling(model, {"batch_loss": batch_loss, "grad_hook": grad_hook}, client, rnd, seed)
            self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index), **terms)
        finally:
            for h in handles:
                h.remove()
        return self.keep_and_share(model, store)
