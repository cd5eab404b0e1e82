"""The representation a model's classifier sees (its penultimate features), captured during the ordinary forward.

Methods that regularize representations (MOON's contrast, prototype methods) need z = r(x), the input of the final
linear layer, beside the logits. A forward hook records it, so the batch is forwarded once.

The same representations, gathered over a client's images, give the spectrum of their covariance: the measure of
dimensional collapse (representations that span few directions) in F²DC's Fig. 1."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

from fedsilo.client.data import to_float
from fedsilo.config import NormalizeParams


def classifier(model: nn.Module) -> nn.Linear:
    """The model's final linear layer: the last ``nn.Linear`` of its head (a LayeredNet's ``head()``, a module
    named ``head`` such as pFedDB's private head g_p), or of the model."""
    head = getattr(model, "head", None)
    scope = head if isinstance(head, nn.Module) else head() if callable(head) else model
    found = [m for m in scope.modules() if isinstance(m, nn.Linear)]
    if not found:
        raise ValueError(f"{type(model).__name__}: no linear classifier to take the representation from")
    return found[-1]


class Representation:
    """Holds the input of the classifier of the latest forward (``z``)."""

    def __init__(self) -> None:
        self.z: Optional[torch.Tensor] = None


@contextmanager
def input_of(module: nn.Module) -> Iterator[Representation]:
    """Inside the block, every forward pass through ``module`` leaves the module's input in the yielded ``.z`` (a
    forward pre-hook, removed on leaving): the classifier's input (:func:`representation`), a head unit's (pFedDIL's
    shared representation), FedCIL's discriminator features."""
    rep = Representation()

    def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        rep.z = inputs[0]

    handle = module.register_forward_pre_hook(hook)
    try:
        yield rep
    finally:
        handle.remove()


def representation(model: nn.Module):
    """``with representation(model) as rep: model(x); rep.z`` -> the B x d features the classifier received."""
    return input_of(classifier(model))


@torch.no_grad()
def features(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """z = r(x) of a model used as a fixed reference (a teacher, the global model): no gradient."""
    with representation(model) as rep:
        model(x)
    assert rep.z is not None
    return rep.z


@torch.no_grad()
def features_of(model: nn.Module, x_u8: torch.Tensor, norm: NormalizeParams, batch_size: int = 256) -> torch.Tensor:
    """z = r(x) (float32) of the uint8 images ``x_u8`` on the input scale ``norm``, batch by batch, the model in eval
    mode (BatchNorm's running statistics, no dropout) and put back in the mode it was in: what a client computes of
    its training images to send or to align to (FedPAC's statistics and prototypes, FedeCouple's anchors)."""
    was = model.training
    model.eval()
    try:
        if not len(x_u8):  # a client without images: no rows, the classifier's input width
            return torch.zeros(0, classifier(model).in_features, device=x_u8.device)
        return torch.cat([features(model, to_float(x_u8[i : i + batch_size], norm)).float() for i in range(0, len(x_u8), batch_size)])
    finally:
        model.train(was)


@torch.no_grad()
def covariance_spectrum(model: nn.Module, x_u8: torch.Tensor, norm: NormalizeParams, batch_size: int = 256) -> torch.Tensor:
    """Singular values, largest first, of the covariance matrix of the representations z = r(x) of the images
    ``x_u8`` on the input scale ``norm`` (the model in eval mode, float32): d values for a d-dimensional representation, at most n - 1 of them
    non-zero for n images. A collapsed representation has most of its singular values near zero (F²DC Fig. 1;
    Jing et al., ICLR 2022)."""
    model.eval()
    z = features_of(model, x_u8, norm, batch_size).flatten(1).double()
    if len(z) < 2:
        raise ValueError(f"covariance_spectrum: needs at least 2 images, got {len(z)}")
    z = z - z.mean(0, keepdim=True)
    # the covariance z^T z / (n-1) is symmetric PSD: its singular values are the squared singular values of z over
    # n-1, the rest zeros; an SVD of the n x d matrix instead of the d x d one (n is a client's test set, d = 512)
    s = torch.linalg.svdvals(z).square() / (len(z) - 1)
    out = torch.zeros(z.shape[1], dtype=s.dtype, device=s.device)
    out[: len(s)] = s
    return out.float().cpu()


def effective_rank(singular_values: torch.Tensor) -> float:
    """exp of the entropy of the normalized singular values (Roy & Vetterli 2007): d for a flat spectrum, 1 for a
    single direction; the one-number summary of a spectrum's collapse."""
    s = singular_values.double().clamp_min(0)
    total = float(s.sum())
    if total <= 0:
        return 0.0
    p = s / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))
