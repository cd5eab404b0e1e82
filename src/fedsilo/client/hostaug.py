"""Host-side augmentation policies through albumentations (``train.augment.host``): medical-style transforms (CLAHE,
affine, brightness / contrast, ...) that have no cheap tensor form run on the CPU per image, before the batch goes to
the device, where the cheap flips and crops (``train.augment.hflip`` / ``crop_pad``) stay.

A policy is a list of albumentations transforms, each ``{name: <class>, <its arguments>}``, applied in order as one
``albumentations.Compose``. Its random draws come from the run's own generator (one seed drawn per batch from the
client's round generator), so a run with a policy is as reproducible as one without, and a run without one draws
nothing extra: its numbers are those of before policies existed."""

from __future__ import annotations

import copy
import functools
import json
import threading
from typing import Any, Optional, Sequence

import numpy as np
import torch

from fedsilo.config import ConfigError

KEY = "train.augment.host"


def _specs(host: Sequence[Any]) -> str:
    """``train.augment.host`` (its validated entries) as the key of the built policy."""
    return json.dumps([h.model_dump(mode="json") for h in host], sort_keys=True)


@functools.lru_cache(maxsize=16)
def _compose(specs_json: str):
    import albumentations as A  # without its version check: fedsilo/__init__.py sets NO_ALBUMENTATIONS_UPDATE
    from pydantic import ValidationError

    transforms = []
    for i, spec in enumerate(json.loads(specs_json)):
        name = spec.pop("name", None)
        cls = getattr(A, str(name), None)
        if not (isinstance(cls, type) and issubclass(cls, A.BasicTransform)):
            raise ConfigError(f"{KEY}[{i}].name: {name!r} is not an albumentations transform (e.g. CLAHE, Affine, RandomBrightnessContrast)")
        try:
            transforms.append(cls(**spec, strict=True))  # strict: an argument the transform does not take is an error
        except (TypeError, ValueError, ValidationError) as err:
            first = str(err).strip().splitlines()
            raise ConfigError(f"{KEY}[{i}] ({name}): {' '.join(first[:3])}") from None
    return A.Compose(transforms, strict=True)


_per_thread = threading.local()


def host_policy(host: Sequence[Any]) -> Optional[Any]:
    """The ``albumentations.Compose`` of ``train.augment.host``, or None when it is empty. An unknown transform or
    argument is a :class:`ConfigError` naming ``train.augment.host[i]``. Each thread gets its own copy: the policy is
    re-seeded per batch and draws per image, so clients trained at once (``train.parallel_clients``) must not share
    one."""
    if not host:
        return None
    key = _specs(host)
    mine = _per_thread.__dict__.setdefault("policies", {})
    if key not in mine:
        mine[key] = copy.deepcopy(_compose(key))
    return mine[key]


def check_host_policy(host: Sequence[Any], where: str) -> None:
    """Build a ``train.augment.host`` policy once: an unknown transform or argument is a :class:`ConfigError` naming
    the whole key (``where``: what comes before ``train.``, ``experiments.<e>.`` or a federation file's ``<path>: ``),
    from ``fedsilo check-params``, before a run's first round and when a federation file is loaded, not from inside a
    first batch."""
    try:
        host_policy(host)
    except ConfigError as err:
        raise ConfigError(f"{where}{err}") from None


def apply_host(policy: Any, x_u8: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``policy`` on every image of a uint8 N x C x H x W batch (any device), on the host; returns the batch on
    ``x_u8``'s device. The policy is re-seeded from ``gen`` for each batch. A transform that changes an image's size
    or channels is a :class:`ConfigError` (a batch must keep its shape)."""
    policy.set_random_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    arr = x_u8.permute(0, 2, 3, 1).cpu().numpy()
    out = np.empty_like(arr)
    for i, img in enumerate(arr):
        res = policy(image=img)["image"]
        if res.ndim == 2:  # a grey transform's result without its channel axis
            res = res[:, :, None]
        if res.shape != img.shape:
            raise ConfigError(f"{KEY}: the policy turned a {img.shape} image into {res.shape}; use size-preserving transforms")
        out[i] = res
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous().to(x_u8.device)
