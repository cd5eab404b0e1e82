"""The representation a model's classifier sees (its penultimate features), captured during the ordinary forward.

Methods that regularize representations (MOON's contrast, prototype methods) need z = r(x), the input of the final
linear layer, beside the logits. A forward hook records it, so the batch is forwarded once."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn


def classifier(model: nn.Module) -> nn.Linear:
    """The model's final linear layer (the last ``nn.Linear`` of its head, or of the model)."""
    scope = model.head() if hasattr(model, "head") else model
    found = [m for m in scope.modules() if isinstance(m, nn.Linear)]
    if not found:
        raise ValueError(f"{type(model).__name__}: no linear classifier to take the representation from")
    return found[-1]


class Representation:
    """Holds the input of the classifier of the latest forward (``z``)."""

    def __init__(self) -> None:
        self.z: Optional[torch.Tensor] = None


@contextmanager
def representation(model: nn.Module) -> Iterator[Representation]:
    """``with representation(model) as rep: model(x); rep.z`` -> the B x d features the classifier received."""
    rep = Representation()

    def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        rep.z = inputs[0]

    handle = classifier(model).register_forward_pre_hook(hook)
    try:
        yield rep
    finally:
        handle.remove()


@torch.no_grad()
def features(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """z = r(x) of a model used as a fixed reference (a teacher, the global model): no gradient."""
    with representation(model) as rep:
        model(x)
    assert rep.z is not None
    return rep.z
