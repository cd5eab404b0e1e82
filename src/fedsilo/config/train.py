"""How a run trains (``experiments.<e>.train``, ``.onboarding``) and the experiment that holds it. With ``base.py``
the part of the params code in every run's code hash (``fedsilo.codehash.TRAIN_CODE``): a changed default here
retrains, an edit of the other modules of this package does not."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fedsilo.config.base import ConfigError, Strict
from fedsilo.config.split import SplitParams


# --------------------------------------------------------------------------- train
class HostTransformParams(BaseModel):
    """One albumentations transform of a host policy: ``name`` (its class) and its own arguments, passed as given and
    checked by albumentations when the policy is built (``fedsilo.client.hostaug``)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(..., min_length=1, description="an albumentations transform, e.g. CLAHE, Affine, RandomBrightnessContrast")


class AugmentParams(Strict):
    hflip: bool = False
    crop_pad: int = Field(0, ge=0)
    host: tuple[HostTransformParams, ...] = Field(
        (), description="albumentations transforms run on the host per image before the batch goes to the device "
        "(medical-style: CLAHE, Affine, RandomBrightnessContrast, ...); flips and crops above stay on the device"
    )


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class NormalizeParams(Strict):
    """The model's input scale: an image's uint8 value v becomes (v / 255 - mean) / std, per channel, as torchvision's
    ``ToTensor`` then ``Normalize(mean, std)`` make it in the papers' code. One value applies to every channel, or one
    per channel of the images. The default (0.5, 0.5) is [-1, 1] (FedBN's digits, MOON); ``imagenet`` stands for
    torchvision's ImageNet statistics (F²DC's code, every dataset); mean 0 and std 1 is ToTensor alone ([0, 1])."""

    mean: tuple[Annotated[float, Field(ge=0, le=1)], ...] = Field(
        (0.5,), min_length=1, description="subtracted after scaling to [0, 1]: one value, or one per channel (on that "
        "[0, 1] scale, as torchvision's: ImageNet's 0.485, not 123.7)",
    )
    std: tuple[Annotated[float, Field(gt=0, le=1)], ...] = Field(
        (0.5,), min_length=1, description="divided by after: one value, or one per channel (on the [0, 1] scale)"
    )

    @model_validator(mode="before")
    @classmethod
    def _named(cls, v: Any) -> Any:
        if v == "imagenet":
            return {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}
        if isinstance(v, str):
            raise ValueError(f"{v!r}: expected imagenet or {{mean: [...], std: [...]}}")
        return v

    @model_validator(mode="after")
    def _lengths(self) -> "NormalizeParams":
        if len(self.mean) != len(self.std) and 1 not in (len(self.mean), len(self.std)):
            raise ValueError(f"mean has {len(self.mean)} values and std {len(self.std)}: give one value or one per channel for each")
        return self

    @property
    def minus_one_one(self) -> bool:
        """[-1, 1], however written (one 0.5 or one per channel)."""
        return set(self.mean) == {0.5} and set(self.std) == {0.5}

    def channel_mismatch(self, channels: int) -> Optional[str]:
        """Why these statistics do not fit images of ``channels`` channels, or None."""
        for name, vals in (("mean", self.mean), ("std", self.std)):
            if len(vals) not in (1, channels):
                return f"{name} has {len(vals)} values for images of {channels} channel(s): give one, or {channels}"
        return None


# The smallest image edge (px) each backbone's strides and poolings still leave a feature map at (measured by a
# forward pass; tests/test_errors_and_hygiene.py checks the table); the other backbones take any image_size >= 8.
MIN_IMAGE_SIZE = {"alexnet_bn": 63, "densenet121": 29, "lenet5": 16, "fedecouple_cnn": 16, "fedecouple_cnn_gray": 12}
# the backbones train.model_width builds at another width (the others are their papers' fixed architectures)
WIDTH_SCALED = frozenset({"simple_cnn"})
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$")
DEVICE_FORMS = "auto, cpu, cuda or cuda:N (N = 0, 1, ...)"


def min_image_size(model: str) -> int:
    return MIN_IMAGE_SIZE.get(model, 8)


class LRScheduleParams(Strict):
    """The learning rate across rounds. A client's optimizers are fresh every round (FedAvg's ClientUpdate), so a
    schedule sets the rate each round's local training starts from: ``train.lr`` (and every other learning rate of
    the round's local training: a phase's, a classifier epoch's, FedCIL's Adam) times factor(r) for round
    r = 1 .. train.rounds. In a task stream ``train.rounds`` is a task's rounds and the schedule restarts with every
    task. Not scheduled: a server's own optimizer (FedTGP's generator, FedCIL's consolidation), the fine-tuning a
    client does to be evaluated (FT-FedAvg, FedBABU: their ``finetune_*`` settings) and pFedDB's onboarding of a
    newcomer (its rounds are not the federation's)."""

    kind: Literal["constant", "step", "exponential", "cosine"] = Field(
        "constant", description="constant: factor 1; step: gamma after each milestone (FedBABU's code: x0.1 after T/2 "
        "and 3T/4); exponential: gamma^(r-1) (FedRCL's code: 0.998; FDSE's: 0.9998); cosine: from 1 down to "
        "min_factor, as torch's CosineAnnealingLR(T_max=train.rounds) stepped once a round",
    )
    gamma: Optional[float] = Field(None, gt=0, lt=1, description="step: the factor at each milestone; exponential: the factor per round")
    milestones: tuple[int, ...] = Field((), description="step: the rounds after which the rate is multiplied by gamma")
    min_factor: float = Field(0.0, ge=0, lt=1, description="cosine: the factor it reaches after the last round")
    warmup_rounds: int = Field(0, ge=0, description="linear warm-up: round r <= warmup_rounds trains at r / warmup_rounds "
                               "of the schedule's rate (0: none; 1 would change no round and is refused)")

    @field_validator("milestones", mode="before")
    @classmethod
    def _one_milestone(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) and not isinstance(v, bool) else v  # `milestones: 150` for [150]

    @model_validator(mode="after")
    def _fits_kind(self) -> "LRScheduleParams":
        if self.kind in ("step", "exponential") and self.gamma is None:
            raise ValueError(f"gamma: kind {self.kind} needs its factor (e.g. 0.1 for step, 0.998 for exponential)")
        if self.kind not in ("step", "exponential") and self.gamma is not None:
            raise ValueError(f"gamma: applies to kind step or exponential, not {self.kind}")
        if self.kind == "step" and not self.milestones:
            raise ValueError("milestones: kind step needs the rounds after which the rate drops")
        if self.kind != "step" and self.milestones:
            raise ValueError(f"milestones: apply to kind step, not {self.kind}")
        if list(self.milestones) != sorted(set(self.milestones)) or any(m < 1 for m in self.milestones):
            raise ValueError(f"milestones: rounds >= 1 in increasing order, got {list(self.milestones)}")
        if self.warmup_rounds == 1:
            raise ValueError("warmup_rounds: 1 changes no round (round 1 at 1/1 of its rate); 0 for none, 2 or more to warm up")
        if self.milestones and self.warmup_rounds > self.milestones[0]:
            raise ValueError(f"warmup_rounds: {self.warmup_rounds} reaches past the first milestone ({self.milestones[0]}): the "
                             "rate would drop while it still warms up")
        if self.kind != "cosine" and self.min_factor:
            raise ValueError(f"min_factor: applies to kind cosine, not {self.kind}")
        return self

    def factor(self, rnd: int, rounds: int) -> float:
        """The multiplier of round ``rnd``'s learning rates (1-based; in a task stream, rounds count within the task:
        ``rounds`` is a task's)."""
        r = (rnd - 1) % rounds + 1
        if self.kind == "step":
            f = float(self.gamma) ** sum(m < r for m in self.milestones)  # type: ignore[arg-type]
        elif self.kind == "exponential":
            f = float(self.gamma) ** (r - 1)  # type: ignore[arg-type]
        elif self.kind == "cosine":
            f = self.min_factor + (1 - self.min_factor) * (1 + math.cos(math.pi * (r - 1) / rounds)) / 2
        else:
            f = 1.0
        if self.warmup_rounds and r <= self.warmup_rounds:
            f *= r / self.warmup_rounds
        return f


class LocalOptimizer(Strict):
    """``methods.<key>.local_optimizer``: the optimizer settings of this method's local training where they differ from
    the experiment's ``train`` (a key left out keeps the experiment's): an authors' code that trains its method with
    another optimizer than the baselines of the same table (F²DC's: SGD lr 0.1, no momentum, no weight decay), beside
    them on the same federation."""

    optimizer: Optional[Literal["sgd", "adam"]] = None
    lr: Optional[float] = Field(None, gt=0)
    momentum: Optional[float] = Field(None, ge=0, lt=1)
    nesterov: Optional[bool] = None
    betas: Optional[tuple[float, float]] = None
    eps: Optional[float] = Field(None, gt=0)
    weight_decay: Optional[float] = Field(None, ge=0)

    def applied(self, train: "TrainParams", what: str) -> "TrainParams":
        """``train`` with these settings in place of its own, validated as a whole (``what`` names the key in errors)."""
        given = self.model_dump(exclude_none=True)
        if not given:
            return train
        try:
            return TrainParams.model_validate({**train.model_dump(), **given})
        except ValidationError as err:
            msg = err.errors()[0]["msg"].removeprefix("Value error, ")
            raise ConfigError(f"{what}: {msg} (the train it changes: {train.optimizer}, lr {train.lr}, momentum "
                              f"{train.momentum}, nesterov {train.nesterov}; a key left out keeps the train's value: set "
                              "it here too)") from None


class TrainParams(Strict):
    model: Literal[
        "simple_cnn", "alexnet_bn", "densenet121", "resnet10", "resnet10_cifar", "resnet18", "resnet34", "resnet34_cifar", "resnet32", "lenet5",
        "fedecouple_cnn", "fedecouple_cnn_gray", "vit_tiny",
    ] = "simple_cnn"
    model_width: float = Field(
        1.0, gt=0, le=4, description="simple_cnn's channels and hidden units times this (1.0: FedBN's DigitModel; 0.25: "
        "the same layers with 16x fewer weights, for CPU quickstarts and pipeline checks); the other models have "
        "their papers' fixed widths",
    )
    rounds: int = Field(300, ge=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    optimizer: Literal["sgd", "adam"] = Field(
        "sgd", description="local optimizer, a fresh one each local update: sgd (lr, momentum, nesterov, weight_decay) "
        "or adam (torch.optim.Adam: lr, betas, eps, weight_decay as an L2 term)",
    )
    lr: float = Field(1e-2, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD's momentum (Adam's are betas)")
    nesterov: bool = Field(False, description="Nesterov momentum (needs momentum > 0; CD2-pFed's SGD)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam's (beta1, beta2), torch's defaults")
    eps: float = Field(1e-8, gt=0, description="Adam's epsilon, torch's default")
    weight_decay: float = Field(0.0, ge=0)
    client_fraction: float = Field(1.0, gt=0, le=1)
    client_fraction_range: Optional[tuple[float, float]] = Field(
        None, description="[low, high]: each round's join ratio drawn uniformly from it, seeded by (seed, round), in place "
        "of client_fraction (FedeCouple Fig. 12's random aggregation ratios)",
    )
    eval_every: int = Field(1, ge=1)
    augment: AugmentParams = AugmentParams()
    normalize: NormalizeParams = Field(
        NormalizeParams(), description="the model's input scale: (v / 255 - mean) / std per channel; [-1, 1] by default, "
        "imagenet for torchvision's ImageNet statistics (F²DC's code)",
    )
    lr_schedule: LRScheduleParams = Field(
        LRScheduleParams(), description="the learning rate across rounds (constant by default): step, exponential or "
        "cosine decay, with an optional linear warm-up; it scales every learning rate of a round's local training",
    )
    device: str = Field("auto", description="auto (the first CUDA device, else the CPU), cpu, cuda or cuda:N")
    amp: Literal["auto", "off", "bf16"] = Field("auto", description="auto = bf16 autocast on CUDA, off on CPU")
    channels_last: Literal["auto", "on", "off"] = Field("auto", description="auto = on for CUDA convnets")
    compile: bool = Field(False, description="torch.compile the model once per run")
    deterministic: bool = Field(
        False, description="deterministic kernels (torch.use_deterministic_algorithms, cuDNN without autotuning, "
        "cuBLAS's fixed workspace): the same numbers for the same seed on a GPU too, at some speed; on the CPU the "
        "kernels already are; an op with no deterministic kernel stops the run naming it",
    )
    count_flops: bool = Field(
        True, description="count the floating-point operations of the last round's local training (matrix products "
        "and convolutions, forward and backward, torch.utils.flop_counter; the last round is a method's steady state: "
        "its references, prototypes and phases are in place) into history and metrics.json (F²DC Table 4)",
    )
    parallel_clients: int = Field(
        1, ge=1, description="clients of a round trained at once, each on its own copy of the model (its own CUDA "
        "stream on a GPU; on the CPU each gets threads / parallel_clients of the run's torch threads): several small "
        "clients fill a device one leaves idle. Downloads, uploads and aggregation keep the clients' order, so the "
        "numbers equal a one-at-a-time run with as many threads per client (on a GPU with deterministic kernels: the same numbers). Methods whose "
        "local update keeps state on the method object train one at a time (recorded in metrics.json's engine block)",
    )
    checkpoint_every: Union[int, Literal["auto"]] = Field(
        "auto", description="when the checkpoint (server state, client stores, history) is written; the last round "
        "always is. auto: after a round that ends once the wall time since the last write has reached 20 times what "
        "that write took (a small model's every round, a large personal-model store's every minute or so: the writes "
        "take at most ~5 % of the run); k: every k rounds. A run killed between two writes resumes from the earlier "
        "and trains the rounds after it again, ending with the same numbers; a SIGTERM ends the round in flight and "
        "writes it first",
    )
    store_device: Literal["auto", "device", "host"] = Field(
        "auto", description="where client stores live: on the device when they fit, else pinned host memory"
    )
    ensemble_test: bool = Field(
        False, description="also score the ensemble of every client's evaluation model (mean softmax) on the union of "
        "the clients' test sets at each evaluation: LG-FedAvg's and CD2-pFed's 'new test'; the models' bytes are "
        "counted as bytes_ensemble. Always on when the split holds an external test site",
    )
    ensemble_mean: Literal["probabilities", "log_probabilities"] = Field(
        "probabilities", description="what the ensemble ('new test') averages over the clients' models: their softmax "
        "probabilities, or their log-probabilities (a normalized geometric mean, as LG-FedAvg's code averages its "
        "log_softmax outputs; CD2-pFed follows it)",
    )
    keep_client_models: bool = Field(
        False, description="also save every client's store (private tensors, personal models) in final_model.pt; the "
        "server state is always saved. Not part of the run's hash: it changes what is saved, not what is trained"
    )

    @field_validator("lr_schedule", mode="before")
    @classmethod
    def _no_schedule(cls, v: Any) -> Any:
        return {} if v is None else v  # `lr_schedule:` left empty, or null: the constant rate

    @field_validator("checkpoint_every", mode="before")
    @classmethod
    def _checkpoint_every(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError(f"expected auto or a whole number of rounds >= 1, got {v!r}")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not DEVICE_RE.match(v):
            raise ValueError(f"'{v}' is not a device; use {DEVICE_FORMS}")
        return v

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> "TrainParams":
        if self.model_width != 1.0 and self.model not in WIDTH_SCALED:
            raise ValueError(f"model_width: {self.model_width}, but {self.model} is built at its paper's width only "
                             f"(model_width applies to {', '.join(sorted(WIDTH_SCALED))}); set it to 1.0")
        if self.nesterov and self.momentum <= 0:
            raise ValueError("nesterov: Nesterov momentum needs momentum > 0")
        if self.optimizer == "adam" and (self.momentum > 0 or self.nesterov):
            raise ValueError("momentum: SGD's momentum (and nesterov) with optimizer: adam; Adam's moments are betas")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: each of Adam's betas must be in [0, 1), got {list(self.betas)}")
        if self.parallel_clients > 1 and self.compile:
            raise ValueError("parallel_clients: torch.compile'd models are not trained from several threads (TorchDynamo "
                             "is not thread-safe); set compile: false or parallel_clients: 1")
        late = [m for m in self.lr_schedule.milestones if m >= self.rounds]
        if late:
            raise ValueError(f"lr_schedule.milestones: {late} not below rounds ({self.rounds}): a drop after the last "
                             "round changes no round")
        if self.lr_schedule.warmup_rounds >= self.rounds:
            raise ValueError(f"lr_schedule.warmup_rounds ({self.lr_schedule.warmup_rounds}) must be below rounds ({self.rounds})")
        if self.client_fraction_range is not None:
            lo, hi = self.client_fraction_range
            if not 0 < lo <= hi <= 1:
                raise ValueError(f"client_fraction_range: needs 0 < low <= high <= 1, got [{lo}, {hi}]")
        return self


class OnboardingParams(Strict):
    """pFedDB Fig. 6: a held-out newcomer adapts with freeze_global / finetune_all / from_scratch."""

    pretrain_rounds: int = Field(10, ge=0, description="rounds of the newcomer's pre-existing local (single-branch) model")
    rounds: int = Field(20, ge=1, description="adaptation rounds per strategy, evaluated after each")


class ExperimentParams(Strict):
    dataset: str
    split: SplitParams
    onboarding: OnboardingParams = OnboardingParams()
    published: Optional[str] = Field(
        None, description="'<file>#<table>' of a paper's published accuracies (e.g. pipelines/pfeddb/published.yaml#chest_xray4) the report sets ours beside"
    )
    target_accuracy: Optional[float] = Field(
        None, gt=0, le=100, description="mean client test accuracy (%) whose first crossing the report times per method: "
        "rounds, training seconds and MiB per client until then (FedeCouple Table VII)",
    )

    train: TrainParams = TrainParams()
