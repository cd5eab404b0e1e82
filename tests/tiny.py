"""Small things learning tests share: a tiny LayeredNet, and a federation made in memory whose domains share the class
signal and differ only in style (four styles of the same 16 px bar images; class = the bar's orientation). Tests use
them where a mechanism's gain must show in seconds on the CPU; the CXR mirrors' shared signal is too weak at test
sizes to separate methods (pFedDB over Single there: +0.004 over three seeds in five minutes)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

from fedsilo.client.data import ClientData
from fedsilo.config import TrainParams
from fedsilo.models import LayeredNet

# what a test scores a model with (client.local.predict): float32 on the CPU, the default [-1, 1] input scale
CPU_TRAIN = TrainParams(device="cpu")


def tiny_net(in_channels: int, num_classes: int, seed: int = 0) -> LayeredNet:
    """Two conv units and a linear head (about 1.5 k parameters), so every method here trains in a second."""
    from torch import nn

    torch.manual_seed(seed)
    return LayeredNet([
        ("conv1", nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)), 1),
        ("conv2", nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()), 1),
        ("fc", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes)), 1),
    ])


def small_cnn(in_channels: int, num_classes: int, seed: int = 0) -> LayeredNet:
    """Three conv units (16, 32, 64 channels, BatchNorm, ReLU, 2x2 max-pooling) and a head (global pool, FC 64 with
    BatchNorm, FC classes): 33 k parameters, the layer kinds of FedBN's Simple-CNN (about 14 M: its FC 6272 -> 2048
    alone makes a test round on the CXR mirrors several times slower) for engine tests where the backbone's size
    does not matter. With SGD momentum 0.9 Single and FedBN pass 0.9 on the mirror's clients in 12 rounds."""
    from torch import nn

    torch.manual_seed(seed)

    def unit(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))

    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, num_classes))
    return LayeredNet([("conv1", unit(in_channels, 16), 1), ("conv2", unit(16, 32), 1), ("conv3", unit(32, 64), 1), ("fc", head, 2)])


def _bars(n: int, rng: np.random.Generator, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Class c: a bar in orientation c (horizontal, vertical, diagonal, anti-diagonal) at a random offset."""
    y = rng.integers(0, 4, n)
    x = np.zeros((n, size, size), np.float32)
    for i, c in enumerate(y):
        o = int(rng.integers(3, size - 3))
        for t in range(2, size - 2):
            r, q = [(o, t), (t, o), (t, t), (t, size - 1 - t)][c]
            x[i, r, q] = 1.0
    return x, y


def _styled(x: np.ndarray, domain: int, rng: np.random.Generator) -> np.ndarray:
    """The same shapes in four styles: plain, inverted, low contrast on a checkerboard, on vertical stripes."""
    s = x.shape[-1]
    z = [0.2 + 0.6 * x, 0.8 - 0.6 * x, 0.45 + 0.15 * x + 0.25 * (np.indices((s, s)).sum(0) % 2)[None],
         0.3 + 0.5 * x + 0.25 * np.sin(np.arange(s) / 1.5)[None, None, :]][domain]
    z = z + rng.normal(0, 0.08, z.shape)
    return (np.clip(z, 0, 1) * 255).astype(np.uint8)[:, None]


def style_shifted_federation(n_train: int = 40, n_test: int = 60, per_domain: int = 2, seed: int = 0) -> list:
    """Four domains that share the class signal (bar orientation) and differ only in style, two clients each; the
    clients of a domain share its test set (F²DC's protocol)."""
    rng = np.random.default_rng(seed)
    clients = []
    for d in range(4):
        xt, yt = _bars(n_test, rng)
        x_test, y_test = torch.from_numpy(_styled(xt, d, rng)), torch.from_numpy(yt).long()
        for k in range(per_domain):
            x, y = _bars(n_train, rng)
            clients.append(ClientData(len(clients), f"D{d}-{k}", torch.from_numpy(_styled(x, d, rng)), torch.from_numpy(y).long(),
                                      x_test, y_test, domain=f"D{d}"))
    return clients



def label_skewed_federation(n_clients: int = 4, classes_per_client: int = 2, n_train: int = 40, n_test: int = 30, seed: int = 0) -> list:
    """One style, label skew: client i sees only classes i, i+1, ... (mod 4) in training and testing (the "s classes
    per client" protocol of LG-FedAvg and CD2-pFed), so a personalized model can beat any single global one."""
    rng = np.random.default_rng(seed)
    clients = []
    for i in range(n_clients):
        keep = [(i + j) % 4 for j in range(classes_per_client)]
        parts = []
        for n in (n_train, n_test):
            x, y = _bars(4 * n, rng)
            sel = np.isin(y, keep)
            x, y = x[sel][:n], y[sel][:n]
            parts += [torch.from_numpy(_styled(x, 0, rng)), torch.from_numpy(y).long()]
        clients.append(ClientData(i, f"C{i}", *parts, domain="D0"))
    return clients


def style_stream(n_clients: int = 3, n_train: int = 40, n_test: int = 30, domains: int = 3, seed: int = 0) -> list:
    """A domain-incremental stream for continual tests: ``tasks[t][k]`` is client k's data of task t, the tasks being
    the bar images in style t (same classes, a new style per task), every client with its own train and test draw."""
    rng = np.random.default_rng(seed)
    tasks = []
    for d in range(domains):
        row = []
        for k in range(n_clients):
            parts = []
            for n in (n_train, n_test):
                x, y = _bars(n, rng)
                parts += [torch.from_numpy(_styled(x, d, rng)), torch.from_numpy(y).long()]
            row.append(ClientData(k, f"C{k}", *parts, domain=f"S{d}"))
        tasks.append(row)
    return tasks


def resume_mid_run(make, tmp_path, rounds: int = 3) -> tuple:
    """A continual run stopped after ``rounds`` rounds (mid-task) and rebuilt from its checkpoint, beside the same run
    uninterrupted: ``make(checkpoint)`` builds the engine. Returns (the resumed engine, the full run's history)."""
    full = make(tmp_path / "a.pt").run()
    part = make(tmp_path / "b.pt")
    for _ in range(rounds):
        part.step()
    resumed = make(tmp_path / "b.pt")
    assert resumed.round == rounds
    return resumed, full


def without_timing(history: list) -> list:
    """A run's history without its wall-clock fields (they describe the machine, not the result)."""
    return [{k: v for k, v in h.items() if k not in ("seconds", "train_seconds")} for h in history]


def finite_stream_summary(history: list, names: list, per_task: int) -> dict:
    """The continual summary of a three-task run, checked whole and finite (matrix, Avg, forgetting, losses)."""
    import math

    from fedsilo.fl.continual import continual_summary

    s = continual_summary(history, names, per_task)
    assert [len(r) for r in s["accuracy_matrix"]] == [1, 2, 3]
    assert all(math.isfinite(v) for row in s["accuracy_matrix"] for v in row)
    assert math.isfinite(s["avg_acc"]) and math.isfinite(s["forgetting"])
    assert all(math.isfinite(v) for h in history for v in h["train_loss"].values())
    return s


def close_states(a: dict, b: dict, atol: float = 0.0) -> bool:
    """Two state dicts with the same keys, equal tensor by tensor within ``atol`` (0: exactly, compared in float)."""
    import torch

    return a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=0) for k in a)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside the block (as each ClientApp and Ray worker runs: a convolution summed over another
    number of threads differs in the last float bit), the thread count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
