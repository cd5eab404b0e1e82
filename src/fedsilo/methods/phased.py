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
"""

from __future__ import annotations

import torch

from fedsilo.client.data import ClientData
from fedsilo.client.local import make_generator
from fedsilo.config import ConfigError
from fedsilo.methods.base import State
from fedsilo.methods.sharing import PartialSharing
from fedsilo.models import LayeredNet


class TwoPhase(PartialSharing):
    e0: int = 0
    rnd: int = 0  # the round in progress (the evaluation after round r sees r)

    def phase_one_rounds(self) -> int:
        """E0; methods whose params have no ``local_rounds`` run Phase 2 only."""
        return int(getattr(self.params, "local_rounds", 0))

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        self.e0 = self.phase_one_rounds()
        if self.e0 >= self.train.rounds:
            raise ConfigError(f"methods.{self.key}.local_rounds ({self.e0}) must be below train.rounds ({self.train.rounds})")
        self.rnd = 0

    def phase(self, rnd: int) -> int:
        return 1 if rnd <= self.e0 else 2

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
        return 0 < self.e0 == rnd

    def download(self, server, client, rnd):
        return {} if self.phase(rnd) == 1 else super().download(server, client, rnd)

    def local_update(self, model, store, payload, client, rnd, seed):
        if self.phase(rnd) == 2:
            return self.federated_update(model, store, payload, client, rnd, seed)
        self.last_loss = self.local_phase_update(model, store, client, make_generator(seed, rnd, client.index))
        return self.phase_one_upload(model, store) if rnd == self.e0 else {}
