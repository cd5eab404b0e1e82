"""Local training and evaluation on one client's device-resident data."""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch import nn

from fedsilo.client.data import ClientData, to_float, training_batch
from fedsilo.client.hostaug import apply_host, host_policy
from fedsilo.config import ConfigError, TrainParams

ExtraLoss = Callable[[nn.Module], torch.Tensor]
# a loss term computed per batch from its inputs, labels and the model's logits (distillation, smoothness terms)
BatchLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# a method's own augmentation of a training batch (x float, y labels) -> the batch trained on
BatchTransform = Callable[[torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


def make_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from a tuple of integers (seed, round, client, ...): the randomness of every round
    is a pure function of these keys, so a resumed run draws exactly what an uninterrupted one draws.

    NumPy's SeedSequence pads the keys with zeros up to four 32-bit words: (s, r, c, 0) draws what (s, r, c) draws
    (but (s, r, c, 0, 0) does not). Methods use that on purpose
    (Ditto's global update and FedRep's head phase draw FedAvg's batches); two streams that must differ need keys that
    differ before their trailing zeros (a last key of 1, 2, ...). Changing the rule would change every number."""
    seq = np.random.SeedSequence([int(k) for k in keys])
    g = torch.Generator()
    g.manual_seed(int(seq.generate_state(1, dtype=np.uint64)[0] & ((1 << 63) - 1)))
    return g


def use_bf16(cfg: TrainParams, device: torch.device) -> bool:
    return device.type == "cuda" and cfg.amp in ("auto", "bf16")


def use_channels_last(cfg: TrainParams, device: torch.device) -> bool:
    return cfg.channels_last == "on" or (cfg.channels_last == "auto" and device.type == "cuda")


log = logging.getLogger(__name__)


@contextmanager
def running_stats_frozen(module: nn.Module) -> Iterator[None]:
    """Inside the block the BatchNorm layers of ``module`` still normalize a training batch by its own statistics but
    leave their running statistics as they are."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in norms:
            m.track_running_stats = True


def _hooks(model: nn.Module) -> tuple[int, ...]:
    """The ids of the forward and forward-pre hooks on the model's modules (their handles' keys)."""
    return tuple(k for m in model.modules() for k in (*m._forward_pre_hooks, *m._forward_hooks))


def compile_model(model: nn.Module) -> None:
    """``train.compile``: torch.compile the model once, kept outside the module tree (state_dict keys stay the same),
    with the forward hooks it was compiled with. TorchDynamo does not guard on hooks added later (its
    ``skip_nnmodule_hook_guards``): a hook a method registers for one local update or evaluation (the features the
    classifier sees, FedRCL's levels) would never run in the compiled forward, so :func:`forward_fn` runs the model
    itself while such a hook is on."""
    model.__dict__["_fedsilo_compiled"] = (torch.compile(model), _hooks(model))


def forward_fn(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The compiled forward when the engine compiled the model (``train.compile``) and no hook was added to it since,
    else the model (a method's hooks run only in the model's own forward: :func:`compile_model`)."""
    got = model.__dict__.get("_fedsilo_compiled")
    if got is None:
        return model
    compiled, hooks = got
    if _hooks(model) != hooks:
        if not model.__dict__.get("_fedsilo_said_hooks"):
            model.__dict__["_fedsilo_said_hooks"] = True
            log.warning("train.compile: the method hooks the model's forward for some passes (features for its loss); "
                        "those passes run the model uncompiled, as TorchDynamo would leave the hooks out")
        return model
    return compiled


def _prep(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x


def batches(n: int, batch_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    perm = torch.randperm(n, generator=gen)
    out = list(perm.split(batch_size))
    # a batch of one breaks BatchNorm in training mode; fold it into the previous batch
    if len(out) > 1 and len(out[-1]) == 1:
        last = out.pop()
        out[-1] = torch.cat([out[-1], last])
    return out


def training_batches(data: ClientData, cfg: TrainParams, gen: torch.Generator, host: Optional[Any] = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One local epoch of a client's training batches, (x, y) on its device: the seeded order (:func:`batches`),
    ``host`` (:func:`fedsilo.client.hostaug.host_policy` of ``train.augment.host``, built once by the caller) on the
    host, then ``train.augment`` and the input scale on the device, in the memory format the model runs in. What every
    local training loop iterates (train_local's, FedCIL's ACGAN's)."""
    cl = use_channels_last(cfg, data.x_train.device)
    for idx in batches(data.n_train, cfg.batch_size, gen):
        idx = idx.to(data.x_train.device, non_blocking=True)
        xb = data.x_train[idx] if host is None else apply_host(host, data.x_train[idx], gen)
        yield _prep(training_batch(xb, cfg, gen), cl), data.y_train[idx]


def batches_per_epoch(n: int, batch_size: int) -> int:
    """How many batches ``batches`` makes of n samples (a last batch of one joins the previous batch)."""
    k = -(-n // batch_size)
    return k - 1 if k > 1 and n % batch_size == 1 else k


_LR_FACTOR: ContextVar[float] = ContextVar("fedsilo_lr_factor", default=1.0)


@contextmanager
def scheduled_lr(cfg: TrainParams, rnd: int) -> Iterator[float]:
    """Round ``rnd``'s local training inside the block: every optimizer built in it (:func:`make_optimizer`,
    :func:`lr_now`) starts at its learning rate times ``train.lr_schedule``'s factor for the round. The engine and a
    Flower site wrap each client's ``local_update`` in it (per thread: clients trained in parallel each carry the
    round's factor); outside one the factor is 1."""
    token = _LR_FACTOR.set(cfg.lr_schedule.factor(rnd, cfg.rounds))
    try:
        yield _LR_FACTOR.get()
    finally:
        _LR_FACTOR.reset(token)


@contextmanager
def unscheduled_lr() -> Iterator[None]:
    """Inside the block optimizers take their learning rate as given, whatever ``train.lr_schedule`` makes of the
    round's (a rate the authors' code keeps fixed while the rest decays: FedPAC's classifier epoch at 0.1)."""
    token = _LR_FACTOR.set(1.0)
    try:
        yield
    finally:
        _LR_FACTOR.reset(token)


def lr_now(lr: float) -> float:
    """``lr`` as the round in progress trains with it (``train.lr_schedule``; ``lr`` itself outside a round)."""
    return lr * _LR_FACTOR.get()


def make_optimizer(params: list[nn.Parameter], cfg: TrainParams) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``params``: SGD (lr, momentum, Nesterov, weight decay) or Adam (lr, betas, eps, weight
    decay as torch's L2 term). ``train_local`` builds a fresh one on every call, so an optimizer's state (momentum
    buffers, Adam's moments and step count) never outlives a local update: FedAvg's ClientUpdate, and pFedDB's
    Phase-2 Adam "re-created every round" (its authors' ``federated/fed_digits_twophase.py``)."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr_now(cfg.lr), betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr_now(cfg.lr), momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    # TrainParams admits only these two; a copy made with model_copy(update=...) skips that check
    raise ConfigError(f"train.optimizer: {cfg.optimizer!r} is not one of sgd, adam")


def train_local(
    model: nn.Module,
    data: ClientData,
    cfg: TrainParams,
    gen: torch.Generator,
    epochs: Optional[int] = None,
    extra_loss: Optional[ExtraLoss] = None,
    params: Optional[list[nn.Parameter]] = None,
    batch_loss: Optional[BatchLoss] = None,
    grad_hook: Optional[Callable[[], None]] = None,
    batch_transform: Optional[BatchTransform] = None,
    epoch_hook: Optional[Callable[[int], None]] = None,
) -> float:
    """``train.optimizer`` (SGD or Adam, :func:`make_optimizer`) on the client's training data, a fresh optimizer each
    call (as in FedAvg's ClientUpdate).

    ``extra_loss(model)`` adds a term that depends on the parameters only (proximal terms), ``batch_loss(x, y,
    logits)`` one that depends on the batch (distillation), and ``grad_hook()`` runs between backward and the
    optimizer step (gradient clipping), ``batch_transform(x, y)`` after ``train.augment`` (a method's own data
    augmentation, which may add samples), ``epoch_hook(epoch)`` after each epoch's last step (CD2-pFed's temporal
    averaging of the private weights; the optimizer's state carries on). Returns the mean training loss over the last
    epoch."""
    model.train()
    device = data.x_train.device
    bf16 = use_bf16(cfg, device)
    fwd = forward_fn(model)
    trainable = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(trainable, cfg)
    host = host_policy(cfg.augment.host)  # albumentations on the host (train.augment.host), None when not asked for
    loss_fn = nn.CrossEntropyLoss()
    last = 0.0
    for epoch in range(epochs if epochs is not None else cfg.local_epochs):
        total = torch.zeros((), device=device)
        count = 0
        for x, y in training_batches(data, cfg, gen, host):
            n = len(y)  # the batch drawn, before a batch_transform may add samples
            if batch_transform is not None:
                x, y = batch_transform(x, y)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = fwd(x)
                loss = loss_fn(logits, y)
                if extra_loss is not None:
                    loss = loss + extra_loss(model)
                if batch_loss is not None:
                    loss = loss + batch_loss(x, y, logits)
            loss.backward()
            if grad_hook is not None:
                grad_hook()
            opt.step()
            total += loss.detach().float() * n  # stays on the device: no sync per step
            count += n
        last = float(total) / max(count, 1)
        if not math.isfinite(last):  # one check per epoch (the sum already syncs here): a diverged run stops, named
            moments = f"betas {list(cfg.betas)}" if cfg.optimizer == "adam" else f"momentum {cfg.momentum}"
            raise ConfigError(
                f"train.lr: local training diverged (mean loss {last} in local epoch {epoch + 1} with {cfg.optimizer} "
                f"lr {opt.param_groups[0]['lr']:.4g}, {moments}); lower the learning rate"
            )
        if epoch_hook is not None:
            epoch_hook(epoch)
    # the optimizer is part of a reference cycle that only the garbage collector frees: drop its state (momentum
    # buffers, a model's worth of tensors) now, so that memory does not wait for the next collection
    opt.state.clear()
    return last


@torch.no_grad()
def predict(model: nn.Module, x_u8: torch.Tensor, batch_size: int = 256, *, cfg: TrainParams) -> torch.Tensor:
    """The model's logits (float32) for uint8 images, in evaluation mode, batch by batch, on the run's input scale
    (``cfg.normalize``: the one the model was trained on), autocast and memory format."""
    model.eval()
    norm = cfg.normalize
    bf16, cl = use_bf16(cfg, x_u8.device), use_channels_last(cfg, x_u8.device)
    fwd = forward_fn(model)
    logits = []
    for i in range(0, len(x_u8), batch_size):
        with torch.autocast(device_type=x_u8.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits.append(fwd(_prep(to_float(x_u8[i : i + batch_size], norm), cl)).float())
    return torch.cat(logits)


def predict_probabilities(model: nn.Module, images: Any, device: Any, batch_size: int = 256, *, cfg: TrainParams,
                          chunk: int = 4096, desc: str = "", quiet: bool = True) -> np.ndarray:
    """Class probabilities (N x classes, float32) of host images (uint8 H x W x C each: a memory-mapped array or a
    list of arrays), ``chunk`` of them on ``device`` at a time, the images scored shown as progress under ``desc``."""
    from fedsilo.utils.progress import Progress

    out = []
    with Progress(len(images), desc, "image", quiet=quiet or not desc) as bar:
        for s in range(0, len(images), chunk):
            x = torch.from_numpy(np.stack(list(images[s : s + chunk]))).permute(0, 3, 1, 2).contiguous().to(device)
            out.append(predict(model, x, batch_size, cfg=cfg).softmax(1).cpu().numpy())
            bar.update(len(x))
    return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


def score(out: torch.Tensor, y: torch.Tensor, probabilities: bool = False) -> dict[str, float]:
    """Accuracy and cross entropy (and ROC AUC for two classes) of logits, or of class probabilities."""
    logp = out.clamp_min(1e-12).log() if probabilities else out.log_softmax(1)
    res = {"acc": float((out.argmax(1) == y).float().mean()), "loss": float(nn.functional.nll_loss(logp, y))}
    if out.shape[1] == 2:
        prob = (out if probabilities else out.softmax(1))[:, 1].cpu().numpy()
        res["auc"] = binary_auc(y.cpu().numpy(), prob)
    return res


@torch.no_grad()
def evaluate(model: nn.Module, x_u8: torch.Tensor, y: torch.Tensor, batch_size: int = 256, *, cfg: TrainParams) -> dict[str, float]:
    return score(predict(model, x_u8, batch_size, cfg=cfg), y)


def evaluate_client(model: nn.Module, client: ClientData, *, cfg: TrainParams) -> dict[str, float]:
    """:func:`evaluate` on the client's test set, plus ``val_acc`` on its validation images where the split gave it
    some (``n_val``): the scores of the model the client is evaluated with, in the engine and on a Flower site."""
    scores = evaluate(model, client.x_test, client.y_test, cfg=cfg)
    if client.x_val is not None and len(client.x_val):
        scores["val_acc"] = evaluate(model, client.x_val, client.y_val, cfg=cfg)["acc"]
    return scores


def binary_auc(y: np.ndarray, score: np.ndarray) -> float:
    """ROC AUC by the Mann-Whitney rank statistic (ties get average ranks). NaN when one class is absent."""
    from scipy.stats import rankdata

    pos = y == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(score)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
