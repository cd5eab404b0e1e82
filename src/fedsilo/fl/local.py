"""Local training and evaluation on one client's device-resident data."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from fedsilo.config import TrainParams
from fedsilo.fl.data import ClientData, augment, to_float

ExtraLoss = Callable[[nn.Module], torch.Tensor]


def make_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from a tuple of integers (seed, round, client, ...): the randomness of every round
    is a pure function of these keys, so a resumed run draws exactly what an uninterrupted one draws."""
    seq = np.random.SeedSequence([int(k) for k in keys])
    g = torch.Generator()
    g.manual_seed(int(seq.generate_state(1, dtype=np.uint64)[0] & ((1 << 63) - 1)))
    return g


def batches(n: int, batch_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    perm = torch.randperm(n, generator=gen)
    out = list(perm.split(batch_size))
    # a batch of one breaks BatchNorm in training mode; fold it into the previous batch
    if len(out) > 1 and len(out[-1]) == 1:
        out[-2] = torch.cat([out[-2], out.pop()])
    return out


def train_local(
    model: nn.Module,
    data: ClientData,
    cfg: TrainParams,
    gen: torch.Generator,
    epochs: Optional[int] = None,
    extra_loss: Optional[ExtraLoss] = None,
    params: Optional[list[nn.Parameter]] = None,
) -> float:
    """Plain SGD on the client's training data (a fresh optimizer each call, as in FedAvg's ClientUpdate).
    Returns the mean training loss over the last epoch."""
    model.train()
    trainable = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    last = 0.0
    for _ in range(epochs if epochs is not None else cfg.local_epochs):
        total, count = 0.0, 0
        for idx in batches(data.n_train, cfg.batch_size, gen):
            idx = idx.to(data.x_train.device)
            x = augment(to_float(data.x_train[idx]), cfg.augment, gen)
            y = data.y_train[idx]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            if extra_loss is not None:
                loss = loss + extra_loss(model)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
        last = total / max(count, 1)
    return last


@torch.no_grad()
def evaluate(model: nn.Module, x_u8: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> dict[str, float]:
    model.eval()
    logits = []
    for i in range(0, len(y), batch_size):
        logits.append(model(to_float(x_u8[i : i + batch_size])).float())
    out = torch.cat(logits)
    loss = float(nn.functional.cross_entropy(out, y))
    pred = out.argmax(1)
    res = {"acc": float((pred == y).float().mean()), "loss": loss}
    if out.shape[1] == 2:
        prob = out.softmax(1)[:, 1].cpu().numpy()
        res["auc"] = binary_auc(y.cpu().numpy(), prob)
    return res


def binary_auc(y: np.ndarray, score: np.ndarray) -> float:
    """ROC AUC by the Mann-Whitney rank statistic (ties get average ranks). NaN when one class is absent."""
    from scipy.stats import rankdata

    pos = y == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(score)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
