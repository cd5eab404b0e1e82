"""The two-phase protocol: local training first, then federation (pFedDB's Algorithm 1, and FedAvg under it in
pFedDB's Fig. 5).

- Phase 1, rounds 1..E0: every client trains on its own data (``local_phase_update``); nothing is downloaded or
  uploaded.
- Round E0: every client takes part (whatever the sampling fraction) and, after its local training, uploads its
  Phase-1 result once (``phase_one_upload``); the server's sample-size-weighted mean of these uploads is the starting
  point of the federation (pFedDB's Eq. 6).
- Phase 2, rounds E0+1..T: the method's federated round (``federated_update``; partial sharing's by default).

E0 = 0 is the plain one-phase method. The newcomer onboarding of pFedDB reuses ``local_phase_update`` for the
newcomer's pre-existing local model.

Each phase may train with its own optimizer and learning rate (:class:`TwoPhaseParams`: ``phase1_optimizer``,
``phase1_lr``, ``phase2_optimizer``, ``phase2_lr``; null = ``train``'s; each one value or a mapping backbone ->
value): pFedDB's authors' Digits script trains Phase 1 with SGD lr 1e-2 and Phase 2 with Adam lr 1e-2, a new Adam
every round (``federated/fed_digits_twophase.py`` on the dev branch of github.com/yiranpang/pFedDB), the only
two-phase training script they released. A phase's optimizer is built fresh for every local update, as
``train_local`` always does. An Adam phase uses ``train.betas``, ``train.eps`` and ``train.weight_decay``;
``train.momentum`` and ``nesterov`` are SGD's and apply to SGD phases only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import torch
from pydantic import Field, TypeAdapter, field_validator

from fedsilo.client.data import ClientData
from fedsilo.client.local import make_generator
from fedsilo.config import ConfigError, TrainParams
from fedsilo.methods.base import MethodParams, State, check_rounds_fit, one_or_per_backbone
from fedsilo.methods.sharing import PartialSharing, per_backbone
from fedsilo.models import LayeredNet

Optimizer = Literal["sgd", "adam"]
_OPTIMIZER = TypeAdapter(Optional[Optimizer])
_LR = TypeAdapter(Optional[Annotated[float, Field(gt=0, allow_inf_nan=False)]])


class TwoPhaseParams(MethodParams):
    """The per-phase training settings of a two-phase method (null: ``train.optimizer`` / ``train.lr``), each one
    value or a mapping backbone -> value (``{simple_cnn: adam, alexnet_bn: sgd}``: one methods block serving several
    datasets whose recipes differ)."""

    phase1_optimizer: Union[None, Optimizer, dict[str, Optional[Optimizer]]] = Field(
        None, description="Phase 1's optimizer: sgd | adam (null = train.optimizer)"
    )
    phase1_lr: Union[None, float, dict[str, Optional[float]]] = Field(
        None, description="Phase 1's learning rate (null = train.lr)"
    )
    phase2_optimizer: Union[None, Optimizer, dict[str, Optional[Optimizer]]] = Field(
        None, description="Phase 2's optimizer: sgd | adam (null = train.optimizer); a one-phase run is all Phase 2"
    )
    phase2_lr: Union[None, float, dict[str, Optional[float]]] = Field(
        None, description="Phase 2's learning rate (null = train.lr)"
    )

    @field_validator("phase1_optimizer", "phase2_optimizer", mode="before")
    @classmethod
    def _optimizer(cls, value: Any) -> Any:
        return one_or_per_backbone(value, _OPTIMIZER)

    @field_validator("phase1_lr", "phase2_lr", mode="before")
    @classmethod
    def _lr(cls, value: Any) -> Any:
        return one_or_per_backbone(value, _LR)


class TwoPhase(PartialSharing):
    e0: int = 0
    rnd: int = 0  # the round in progress (the evaluation after round r sees r)

    def __init__(self, params, train, key=None):
        super().__init__(params, train, key)
        self.phase_optimizers()  # a mapping without this run's backbone is refused when params are checked

    def phase_one_rounds(self) -> int:
        """E0; methods whose params have no ``local_rounds`` run Phase 2 only."""
        return int(getattr(self.params, "local_rounds", 0))

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        self.e0 = self.phase_one_rounds()
        check_rounds_fit(self, self.key, self.train.rounds, "train.rounds")
        self.rnd = 0

    def phase(self, rnd: int) -> int:
        return 1 if rnd <= self.e0 else 2

    def phase_train(self, phase: int) -> TrainParams:
        """``train`` with phase ``phase``'s optimizer and learning rate where the params set them (for the run's
        backbone where they are given per backbone). SGD's momentum and Nesterov do not carry into an Adam phase
        (Adam's moments are ``train.betas``)."""
        opt, lr = (
            per_backbone(getattr(self.params, f"phase{phase}_{name}", None), self.train.model, f"methods.{self.key}.phase{phase}_{name}")
            for name in ("optimizer", "lr")
        )
        update: dict[str, Any] = {}
        if opt is not None and opt != self.train.optimizer:
            update["optimizer"] = opt
            if opt == "adam":
                update.update(momentum=0.0, nesterov=False)
        if lr is not None:
            update["lr"] = float(lr)
        if not update:
            return self.train
        try:  # validated as a train block of its own
            return TrainParams.model_validate({**self.train.model_dump(), **update})
        except ValueError as err:
            raise ConfigError(f"methods.{self.key}.phase{phase}_optimizer: {err}") from None

    def phase_optimizers(self) -> dict[str, dict[str, Any]]:
        """What each phase that runs trains with (recorded with the run's resolved settings); a one-phase run has no
        Phase 1, and its ``phase1_*`` values are not looked at."""
        out = {}
        for phase in (1, 2) if self.phase_one_rounds() else (2,):
            cfg = self.phase_train(phase)
            out[f"phase{phase}"] = {"optimizer": cfg.optimizer, "lr": cfg.lr}
        return out

    def local_train(self, rnd: int) -> TrainParams:
        return self.phase_train(self.phase(rnd))

    def federated(self) -> bool:
        """True once the server holds a federated state: after round E0 has been aggregated."""
        return self.rnd >= self.e0

    # --- what a subclass defines
    def local_phase_update(self, model: LayeredNet, store: State, client: ClientData, gen: torch.Generator) -> float:
        """Phase 1: train the client's own model on its data, keep it in ``store``; returns the training loss."""
        raise NotImplementedError

    def phase_one_upload(self, model: LayeredNet, store: State) -> State:
        """Round E0, after the local training: what the client uploads to start the federation."""
        raise NotImplementedError

    def federated_update(self, model, store, payload, client, rnd, seed) -> State:
        return super().local_update(model, store, payload, client, rnd, seed)

    # --- the engine's hooks
    def on_round_start(self, model, rnd: int) -> None:
        self.rnd = rnd

    def sample_all(self, rnd: int) -> bool:
        # Phase 1 (rounds 1..E0): every client trains its own model, whatever the sampling fraction (nothing is sent
        # but round E0's upload, which every client makes)
        return 0 < rnd <= self.e0

    def download(self, server, client, rnd):
        return {} if self.phase(rnd) == 1 else super().download(server, client, rnd)

    def local_update(self, model, store, payload, client, rnd, seed):
        if self.phase(rnd) == 2:
            return self.federated_update(model, store, payload, client, rnd, seed)
        self.last_loss = self.local_phase_update(model, store, client, make_generator(seed, rnd, client.index))
        return self.phase_one_upload(model, store) if rnd == self.e0 else {}
