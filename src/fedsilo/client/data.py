"""Client data, resident on the training device as uint8, with normalization and augmentation on the device.

The harmonized ``images.npy`` is memory-mapped once; each client's train and test rows are copied to the device as
uint8 NCHW tensors at start-up. A batch is an index into those tensors: no DataLoader, no worker processes, no
per-round disk reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import torch

from fedsilo.config import DEVICE_FORMS, DEVICE_RE, AugmentParams, ConfigError
from fedsilo.utils.slots import claim_gpu


@dataclass
class ClientData:
    index: int
    name: str
    x_train: torch.Tensor  # uint8 N x C x H x W on device
    y_train: torch.Tensor  # int64 N
    x_test: torch.Tensor
    y_test: torch.Tensor
    domain: str = ""  # the domain (site) the client's data come from; clients of one domain share its test set
    x_val: Optional[torch.Tensor] = None  # the split's validation images (``n_val``), scored each evaluated round
    y_val: Optional[torch.Tensor] = None

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])


def _reader(harmonized_dir: Path, device: torch.device):
    harmonized_dir = Path(harmonized_dir)
    images = np.load(harmonized_dir / "images.npy", mmap_mode="r")
    records = pd.read_parquet(harmonized_dir / "records.parquet", columns=["label"])
    labels = records["label"].to_numpy()
    if len(labels) != images.shape[0]:
        raise ValueError(f"{harmonized_dir}: records.parquet has {len(labels)} rows but images.npy {images.shape[0]}")

    def grab(name: str, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(rows, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(labels)):
            raise ValueError(f"split client {name}: index out of range for {harmonized_dir}")
        x = torch.from_numpy(np.ascontiguousarray(images[idx])).permute(0, 3, 1, 2).contiguous()
        y = torch.from_numpy(labels[idx].astype(np.int64))
        return x.to(device), y.to(device)

    return images, grab


def load_clients(harmonized_dir: Path, split: dict[str, Any], device: torch.device) -> tuple[list[ClientData], int, int]:
    """Returns (clients, in_channels, num_classes)."""
    images, grab = _reader(harmonized_dir, device)
    clients = []
    tests: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    for c in split["clients"]:
        xtr, ytr = grab(c["name"], c["train"])
        # clients that share a test set (F²DC's clients of one domain) share one tensor: loaded once, and an
        # evaluation over the union of the clients' test sets (the ensemble's "new test") counts it once
        key = tuple(int(i) for i in c["test"])
        if key not in tests:
            tests[key] = grab(c["name"], c["test"])
        xte, yte = tests[key]
        xva, yva = grab(c["name"], c["val"]) if c.get("val") else (None, None)
        clients.append(ClientData(int(c["client"]), str(c["name"]), xtr, ytr, xte, yte, str(c.get("domain", c["name"])), xva, yva))
    return clients, int(images.shape[3]), int(split["num_classes"])


def load_task_clients(harmonized_dir: Path, split: dict[str, Any], device: torch.device) -> tuple[list[list[ClientData]], list[str], int, int]:
    """A ``domain_incremental`` split's data: ``tasks[t][k]`` is client k's data of task t (its ``domain`` the task's
    domain). Returns (tasks, task domains in order, in_channels, num_classes)."""
    images, grab = _reader(harmonized_dir, device)
    order = [str(d) for d in split["task_order"]]
    tasks: list[list[ClientData]] = [[] for _ in order]
    for c in split["clients"]:
        if [t["domain"] for t in c["tasks"]] != order:
            raise ValueError(f"split client {c['name']}: its tasks {[t['domain'] for t in c['tasks']]} are not the split's task order {order}")
        for t, task in enumerate(c["tasks"]):
            xtr, ytr = grab(c["name"], task["train"])
            xte, yte = grab(c["name"], task["test"])
            tasks[t].append(ClientData(int(c["client"]), str(c["name"]), xtr, ytr, xte, yte, str(task["domain"])))
    return tasks, order, int(images.shape[3]), int(split["num_classes"])


def load_external(harmonized_dir: Path, split: dict[str, Any], device: torch.device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The test images and labels of the split's external test site (``holdout_domain`` with ``role:
    external_test``), or None when the split has none."""
    hold = split.get("holdout")
    if not hold or hold.get("role") != "external_test":
        return None
    _, grab = _reader(harmonized_dir, device)
    return grab(str(hold["client"]["name"]), hold["client"]["test"])


def pick_device(name: str, key: str = "train.device") -> torch.device:
    """``auto`` = the first CUDA device when there is one (with ``FEDSILO_GPU_SLOTS`` set and several GPUs, the one
    :func:`fedsilo.utils.slots.claim_gpu` gives this process), else the CPU; ``cpu``, ``cuda`` or ``cuda:N`` as named. A
    device this machine does not have is a :class:`ConfigError` naming ``key``, not a failure inside PyTorch."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # several runs at once on a machine with several GPUs (fedsilo grid's queue workers): each claims its own
        gpu = claim_gpu(torch.cuda.device_count())
        if gpu is None:
            return torch.device("cuda")
        torch.cuda.set_device(gpu)  # code that asks for "the" CUDA device gets this one too
        return torch.device("cuda", gpu)
    if not DEVICE_RE.match(name):
        raise ConfigError(f"{key}: '{name}' is not a device; use {DEVICE_FORMS}")
    dev = torch.device(name)
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"{key}: '{name}', but PyTorch sees no CUDA device on this machine; use auto or cpu")
        if (dev.index or 0) >= n:
            raise ConfigError(f"{key}: '{name}', but PyTorch sees {n} CUDA device(s) (cuda:0 to cuda:{n - 1}); use auto or one of them")
    return dev


def to_float(x_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [0, 255] -> float in [-1, 1]."""
    return x_u8.float().div_(127.5).sub_(1.0)


def augment(x: torch.Tensor, params: AugmentParams, gen: torch.Generator) -> torch.Tensor:
    """Random crop after padding with black and horizontal flip, per sample, on the tensor's device.

    The padding is black (-1 on this [-1, 1] scale), as torchvision's ``RandomCrop(size, padding=p)`` pads an image
    before ``ToTensor`` / ``Normalize`` in the papers' code (F²DC, FPL, MOON, FedBN): zero here would be mid-grey.
    ``gen`` is a CPU generator so that the draws are the same on every device."""
    b, _, h, w = x.shape
    if params.crop_pad > 0:
        p = params.crop_pad
        xp = torch.nn.functional.pad(x, (p, p, p, p), value=-1.0)
        oy = torch.randint(0, 2 * p + 1, (b,), generator=gen).to(x.device)
        ox = torch.randint(0, 2 * p + 1, (b,), generator=gen).to(x.device)
        iy = (torch.arange(h, device=x.device)[None, :] + oy[:, None])  # b x h
        ix = (torch.arange(w, device=x.device)[None, :] + ox[:, None])  # b x w
        bi = torch.arange(b, device=x.device)[:, None, None]
        x = xp.permute(0, 2, 3, 1)[bi, iy[:, :, None], ix[:, None, :]].permute(0, 3, 1, 2)
    if params.hflip:
        flip = (torch.rand(b, generator=gen) < 0.5).to(x.device)
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
    return x


ONE_OP_NAMES = ("crop", "flip", "rotate", "brightness", "invert")


def one_random_op(x: torch.Tensor, gen: torch.Generator, max_crop: int = 4, max_degrees: float = 30.0, max_brightness: float = 0.5) -> torch.Tensor:
    """FedeCouple's data augmentation (Sec. IV, "DA"): each image gets one operation drawn uniformly from crop, flip,
    rotation, brightness and pixel inversion, with a strength drawn uniformly from (0, 1] of the operation's range:
    a random crop after zero padding of up to ``max_crop`` pixels, a horizontal flip, a rotation of up to
    ``max_degrees`` either way, a brightness shift of up to ``max_brightness`` (of the [0, 1] range) either way, an
    inversion. Works on a float batch in [-1, 1]; the draws come from the CPU generator ``gen``."""
    from torchvision.transforms.v2 import functional as TF

    b, _, h, w = x.shape
    ops = torch.randint(0, len(ONE_OP_NAMES), (b,), generator=gen)
    strength = torch.rand(b, generator=gen).clamp_min(1e-3)
    sign = torch.where(torch.rand(b, generator=gen) < 0.5, -1.0, 1.0)
    offsets = torch.rand(b, 2, generator=gen)
    out = []
    for i in range(b):
        img, op, m = x[i], ONE_OP_NAMES[int(ops[i])], float(strength[i])
        if op == "crop":
            p = max(1, int(round(max_crop * m)))
            padded = torch.nn.functional.pad(img, (p, p, p, p))
            oy, ox = int(offsets[i, 0] * (2 * p + 1)), int(offsets[i, 1] * (2 * p + 1))
            img = padded[:, min(oy, 2 * p) : min(oy, 2 * p) + h, min(ox, 2 * p) : min(ox, 2 * p) + w]
        elif op == "flip":
            img = img.flip(2)
        elif op == "rotate":
            img = TF.rotate(img, float(sign[i]) * max_degrees * m, fill=-1.0)
        elif op == "brightness":
            img = (img + 2.0 * max_brightness * m * float(sign[i])).clamp(-1.0, 1.0)
        else:  # invert: 1 - v on [0, 1] is -v on [-1, 1]
            img = -img
        out.append(img)
    return torch.stack(out)
