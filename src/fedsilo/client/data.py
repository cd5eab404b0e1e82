"""Client data, resident on the training device as uint8, with normalization and augmentation on the device.

The harmonized ``images.npy`` is memory-mapped once; each client's train and test rows are copied to the device as
uint8 NCHW tensors at start-up. A batch is an index into those tensors: no DataLoader, no worker processes, no
per-round disk reads.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import torch

from fedsilo.config import DEVICE_FORMS, DEVICE_RE, AugmentParams, ConfigError, NormalizeParams, TrainParams
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


@functools.lru_cache(maxsize=64)
def _statistics(mean: tuple[float, ...], std: tuple[float, ...], channels: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """mean and std as 1 x C x 1 x 1 tensors on ``device``, made once per run (not a host-to-device copy a batch)."""
    def col(v: tuple[float, ...]) -> torch.Tensor:
        return torch.tensor(v if len(v) == channels else v * channels, dtype=torch.float32).view(1, channels, 1, 1).to(device)
    out = col(mean), col(std)
    if device.type == "cuda":  # the copies done before a client's own CUDA stream reads them (train.parallel_clients)
        torch.cuda.synchronize(device)
    return out


def to_float(x_u8: torch.Tensor, norm: NormalizeParams) -> torch.Tensor:
    """uint8 [0, 255] (N x C x H x W) -> the model's input: (v / 255 - mean) / std per channel (``train.normalize``);
    the default mean = std = 0.5 is [-1, 1], computed as v / 127.5 - 1."""
    if norm.minus_one_one:
        return x_u8.float().div_(127.5).sub_(1.0)
    channels = int(x_u8.shape[1])
    why = norm.channel_mismatch(channels)
    if why is not None:
        raise ConfigError(f"train.normalize: {why}")
    mean, std = _statistics(norm.mean, norm.std, channels, x_u8.device)
    return x_u8.float().div_(255.0).sub_(mean).div_(std)


def to_minus_one_one(x: torch.Tensor, norm: NormalizeParams) -> torch.Tensor:
    """Images on the input scale ``norm`` made (:func:`to_float`) back on [-1, 1] (v / 127.5 - 1): for an operation
    written for that scale; the default scale is returned as it is."""
    if norm.minus_one_one:
        return x
    mean, std = _statistics(norm.mean, norm.std, int(x.shape[1]), x.device)
    return (x * std + mean) * 2.0 - 1.0


def from_minus_one_one(x: torch.Tensor, norm: NormalizeParams) -> torch.Tensor:
    """The inverse of :func:`to_minus_one_one`: [-1, 1] images onto the input scale ``norm``."""
    if norm.minus_one_one:
        return x
    mean, std = _statistics(norm.mean, norm.std, int(x.shape[1]), x.device)
    return ((x + 1.0) * 0.5 - mean) / std


def black(norm: NormalizeParams, like: torch.Tensor) -> torch.Tensor:
    """A black pixel (uint8 0) on the model's input scale, 1 x C x 1 x 1 for images like ``like``."""
    return to_float(torch.zeros((1, like.shape[1], 1, 1), dtype=torch.uint8, device=like.device), norm)


def _windows(padded: torch.Tensor, iy: torch.Tensor, ix: torch.Tensor) -> torch.Tensor:
    """Image i of ``padded`` (b x c x H x W) read at rows ``iy[i]`` (h) and columns ``ix[i]`` (w): one gather for the
    whole batch (a crop window per image; a column order read backwards is a flip)."""
    bi = torch.arange(padded.shape[0], device=padded.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[bi, iy[:, :, None], ix[:, None, :]].permute(0, 3, 1, 2)


def augment(x: torch.Tensor, params: AugmentParams, gen: torch.Generator, norm: NormalizeParams) -> torch.Tensor:
    """Random crop after padding with black and horizontal flip, per sample, on the tensor's device; ``x`` is on the
    input scale ``norm`` made it (:func:`to_float`).

    The padding is black (uint8 0 on that scale: -1 on the default [-1, 1], (0 - mean) / std per channel else), as
    torchvision's ``RandomCrop(size, padding=p)`` pads an image before ``ToTensor`` / ``Normalize`` in the papers'
    code (F²DC, FPL, MOON, FedBN): zero here would be mid-grey. ``gen`` is a CPU generator so that the draws are the
    same on every device."""
    b, c, h, w = x.shape
    if params.crop_pad > 0:
        p = params.crop_pad
        if norm.minus_one_one:
            xp = torch.nn.functional.pad(x, (p, p, p, p), value=-1.0)
        else:
            xp = black(norm, x).to(x.dtype).expand(b, c, h + 2 * p, w + 2 * p).clone()
            xp[:, :, p : p + h, p : p + w] = x
        oy = torch.randint(0, 2 * p + 1, (b,), generator=gen).to(x.device)
        ox = torch.randint(0, 2 * p + 1, (b,), generator=gen).to(x.device)
        iy = (torch.arange(h, device=x.device)[None, :] + oy[:, None])  # b x h
        ix = (torch.arange(w, device=x.device)[None, :] + ox[:, None])  # b x w
        x = _windows(xp, iy, ix)
    if params.hflip:
        flip = (torch.rand(b, generator=gen) < 0.5).to(x.device)
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
    return x


def training_batch(x_u8: torch.Tensor, train: TrainParams, gen: torch.Generator) -> torch.Tensor:
    """A training batch as local training feeds it to the model: on the run's input scale (``train.normalize``),
    then ``train.augment``'s device crop and flip, drawn from ``gen``."""
    return augment(to_float(x_u8, train.normalize), train.augment, gen, train.normalize)


ONE_OP_NAMES = ("crop", "flip", "rotate", "brightness", "invert")


def one_random_op(x: torch.Tensor, gen: torch.Generator, norm: NormalizeParams, max_crop: int = 4, max_degrees: float = 30.0,
                  max_brightness: float = 0.5) -> torch.Tensor:
    """FedeCouple's data augmentation (Sec. IV, "DA"): each image gets one operation drawn uniformly from crop, flip,
    rotation, brightness and pixel inversion, with a strength drawn uniformly from (0, 1] of the operation's range:
    a random crop after zero padding of up to ``max_crop`` pixels, a horizontal flip, a rotation of up to
    ``max_degrees`` either way, a brightness shift of up to ``max_brightness`` (of the [0, 1] range) either way, an
    inversion. Works on a float batch on the input scale ``norm`` (:func:`to_float`), the operations on [-1, 1] (so
    white inverts to black, brightness clips at black and white, the padding and the rotation's fill are black); the
    draws come from the CPU generator ``gen``.

    The whole batch at once: each image's crop window and flip are one gather from a padded copy, brightness and
    inversion two element-wise ops, and the rotated images one ``grid_sample`` over torchvision's rotation grid (its
    inverse rotation matrix about the centre, its base grid, nearest sampling, the fill -1 where the rotation leaves
    the image), so each image is what ``torchvision.transforms.v2.functional.rotate(img, angle, fill=-1.0)`` gives it
    (torchvision's exact-quarter-turn shortcuts included). Each scalar (padding, window offset, angle, shift) is
    computed in the precision the per-image arithmetic had: Python floats, or float32 where a draw stayed a tensor.
    A test holds the result bit for bit to a loop over the images
    with torchvision's rotate on the CPU; on a GPU the batched grid product may round a grid coordinate differently,
    which can move a rotated pixel at an exact tie of the nearest sampling."""
    x = to_minus_one_one(x, norm)
    b, c, h, w = x.shape
    dev = x.device
    ops = torch.randint(0, len(ONE_OP_NAMES), (b,), generator=gen)
    strength = torch.rand(b, generator=gen).clamp_min(1e-3)
    sign = torch.where(torch.rand(b, generator=gen) < 0.5, -1.0, 1.0)
    offsets = torch.rand(b, 2, generator=gen)
    crop, flip, rot, bright, invert = (ops == k for k in range(len(ONE_OP_NAMES)))
    m = strength.double()
    # crop: image i is padded by p_i = max(1, round(max_crop m_i)) and cut at offset min(floor(u (2 p_i + 1)), 2 p_i);
    # taken here from one copy padded by P >= every p_i, the window starting at offset - p_i + P (P: the identity)
    big = max(1, max_crop)
    p, start = crop_windows(m, offsets, max_crop)
    off = start - p[:, None] + big
    off = torch.where(crop[:, None], off, torch.full_like(off, big))
    iy = torch.arange(h)[None, :] + off[:, :1]
    ix = torch.arange(w)[None, :] + off[:, 1:]
    ix = torch.where(flip[:, None], ix.flip(1), ix)  # the flip: the window read right to left
    iy, ix = iy.to(dev, non_blocking=True), ix.to(dev, non_blocking=True)
    padded = torch.nn.functional.pad(x, (big, big, big, big), value=-1.0)  # black, as the rotation's fill
    out = _windows(padded, iy, ix).contiguous()
    # brightness: the shift as a Python float, 2 s m_i max_brightness, added in the images' dtype; inversion: -v
    shift = (2.0 * max_brightness * m * sign.double()).to(x.dtype)
    if bool(bright.any()):
        i = bright.nonzero().flatten().to(dev)
        out[i] = (out[i] + shift[bright].to(dev)[:, None, None, None]).clamp(-1.0, 1.0)
    if bool(invert.any()):
        i = invert.nonzero().flatten().to(dev)
        out[i] = -out[i]
    if bool(rot.any()):
        _rotate_into(out, x, rot, [float(sign[i]) * max_degrees * float(strength[i]) for i in rot.nonzero().flatten().tolist()])
    return from_minus_one_one(out, norm)


def crop_windows(m: torch.Tensor, u: torch.Tensor, max_crop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One_random_op's crop of strength ``m`` (double) with offset draws ``u`` (float32, b x 2): the padding
    p = max(1, round(max_crop m)) (Python's round: half to even, on doubles) and the window's start (y, x) in the
    p-padded image, min(floor(u (2 p + 1)), 2 p), the product in float32 as a float32 draw times a Python int is
    (in double some starts move: p = 5, u = 7626007 / 2**24 gives 4 instead of 5)."""
    p = torch.round(max_crop * m).clamp_min(1).long()
    return p, (u * (2 * p + 1)[:, None].float()).long().minimum((2 * p)[:, None])


def _rotate_into(out: torch.Tensor, x: torch.Tensor, which: torch.Tensor, angles: list[float]) -> None:
    """``out[i] = rotate(x[i], angle_i, fill=-1)`` for the images ``which`` marks, as torchvision's tensor rotate
    does it (nearest, no expansion, about the centre): angle mod 360, its quarter-turn shortcuts, else the inverse
    matrix [cos a, sin a, 0; -sin a, cos a, 0] of -angle in radians, its normalised base grid, one grid_sample of the
    images with a mask channel, -1 where the mask falls under 0.5."""
    _, c, h, w = x.shape
    dev, dtype = x.device, x.dtype
    idx = which.nonzero().flatten().tolist()
    grid_idx, thetas = [], []
    for i, angle in zip(idx, angles):
        angle = angle % 360
        if angle == 0:
            out[i] = x[i]
        elif angle == 180:
            out[i] = torch.rot90(x[i], k=2, dims=(-2, -1))
        elif h == w and angle in (90, 270):
            out[i] = torch.rot90(x[i], k=1 if angle == 90 else 3, dims=(-2, -1))
        else:
            a = math.radians(-angle)
            grid_idx.append(i)
            thetas.append([math.cos(a), math.sin(a), 0.0, -math.sin(a), math.cos(a), 0.0])
    if not grid_idx:
        return
    k = len(grid_idx)
    theta = torch.tensor(thetas, dtype=dtype, device=dev).reshape(k, 2, 3)
    base = torch.empty(1, h, w, 3, dtype=dtype, device=dev)
    base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=dev))
    base[..., 1].copy_(torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=dev).unsqueeze_(-1))
    base[..., 2].fill_(1)
    scaled = theta.transpose(1, 2).div_(torch.tensor([0.5 * w, 0.5 * h], dtype=dtype, device=dev))
    grid = base.view(1, h * w, 3).expand(k, -1, -1).bmm(scaled).view(k, h, w, 2)
    sel = torch.tensor(grid_idx, device=dev)
    img = torch.cat([x[sel], torch.ones(k, 1, h, w, dtype=dtype, device=dev)], dim=1)
    img = torch.nn.functional.grid_sample(img, grid, mode="nearest", padding_mode="zeros", align_corners=False)
    img, mask = img[:, :c], img[:, c:].expand(-1, c, -1, -1)
    out[sel] = torch.where(mask < 0.5, torch.full_like(img, -1.0), img)
