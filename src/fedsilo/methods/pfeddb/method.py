"""pFedDB (Pang, Ni, Zhong, AAAI 2026): the dual-branch model (``model.py``) under the two-phase protocol.

Protocol (Algorithm 1):
- Phase 1, rounds 1..E0 (``local_rounds``): every client trains the single-branch model g_p(f_p(x)) on its own data;
  nothing is sent. In round E0 every client (all of them, Eq. 6 sums over S) uploads its trained extractor psi_c*
  once, as the initial value of phi, and the server sets phi(0) = sum_c n_c / n psi_c* (Eq. 6).
- Phase 2, rounds E0+1..T: the server broadcasts phi to the sampled clients; each trains phi, psi_c and omega_c
  together (Eq. 7) and uploads phi only; the server takes the sample-size-weighted mean (Eq. 8). psi_c and omega_c
  never leave the client.
- ``two_phase: false`` (Table 4 ablation): the dual-branch model is trained federatedly from round 1, phi and
  psi starting from the same seeded initialisation.

Choices where the paper is open:
- Phase-1 length is counted in rounds of E local epochs, like the paper's "150 rounds of local training" out of 300.
- The paper's "cut depth" counts weighted layers (convolutions and linear layers) as our backbones do: AlexNet
  l_c = 6 shares 71 % of the parameters, DenseNet-121 l_c = 88 (after transition 3) 68-69 %, as in Table 3. A cut
  at the last layer (AlexNet l_c = 8, "Ratio 1.00") leaves an identity head: the fused logits are the output.
- ``cut_depth: null`` picks the unit boundary whose shared fraction is closest to 70 %, the paper's recommendation.
- Evaluation during Phase 1 uses the single-branch local model, afterwards the client's dual-branch model.
- The Phase-1 -> Phase-2 transition sends psi_c* once under phi's names; this is the upload Eq. 6 requires, and it
  is counted in that round's bytes.
- phi is "the parameters of the shared branch": its weights, biases and BatchNorm affine parameters. BatchNorm
  running statistics are buffers, not parameters, and stay with the client by default (each client starts them from
  its own psi_c* clone); ``share_bn_stats: true`` uploads and averages them too. On the CXR mirrors averaging them
  cost 5-7 points of mean accuracy (16 images per client, 14 rounds, two seeds: 0.79 vs 0.86), the FedBN effect
  inside the shared branch.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import torch
from pydantic import Field, PositiveInt
from torch import nn

from fedsilo.client.local import train_local
from fedsilo.config import ConfigError
from fedsilo.methods.base import MethodParams
from fedsilo.methods.pfeddb.model import (
    SHARED,
    DualBranch,
    closest_to_70,
    local_branch_parameters,
    psi_as_phi,
    shared_fraction,
)
from fedsilo.methods.phased import TwoPhase
from fedsilo.models import LayeredNet


class PFedDBParams(MethodParams):
    cut_depth: Union[None, PositiveInt, dict[str, PositiveInt]] = Field(
        None,
        description="l_c in weighted layers; a mapping backbone -> l_c (one methods block serving several backbones, "
        "e.g. {densenet121: 88, alexnet_bn: 6}); null (or a backbone missing from the mapping) = closest to 70 % shared",
    )
    local_rounds: int = Field(150, ge=0, description="E0: Phase-1 rounds of local training")
    two_phase: bool = True
    fusion: Literal["add", "concat", "attention", "weighted"] = "add"
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="weight of the shared branch for fusion=weighted")
    share_bn_stats: bool = Field(False, description="also upload the shared branch's BatchNorm running statistics")


class PFedDB(TwoPhase):
    name = "pfeddb"
    params_cls = PFedDBParams
    params: PFedDBParams

    # ------------------------------------------------------------------ model
    def transform_model(self, model: nn.Module, example: torch.Tensor) -> nn.Module:
        """The backbone becomes f_s, f_p, fusion and g_p, cut after l_c weighted layers."""
        if not isinstance(model, LayeredNet):
            raise TypeError("pfeddb needs a LayeredNet backbone")
        cd = self.params.cut_depth
        depth = cd.get(self.train.model) if isinstance(cd, dict) else cd
        depth = depth or closest_to_70(model)
        if depth > model.num_layers:
            raise ConfigError(f"methods.{self.key}.cut_depth: {depth} exceeds the backbone's {model.num_layers} layers")
        self.cut_depth = depth
        self.backbone_shared_fraction = shared_fraction(model, depth)
        return DualBranch(model, model.cut_index(depth), self.params.fusion, self.params.alpha, example)

    def shared_keys(self, model) -> list[str]:
        """phi: the shared branch's parameters (and, with share_bn_stats, its BatchNorm statistics)."""
        keys = [k for k in model.state_dict() if k.startswith(SHARED)]
        if not self.params.share_bn_stats:
            keys = [k for k in keys if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
        return keys

    def phase_one_rounds(self) -> int:
        return self.params.local_rounds if self.params.two_phase else 0

    def resolved(self) -> dict[str, Any]:
        out = super().resolved()
        if hasattr(self, "cut_depth"):
            out.update(cut_depth=self.cut_depth, backbone_shared_fraction=round(self.backbone_shared_fraction, 6))
        return out

    # ------------------------------------------------------------------ protocol
    def on_round_start(self, model: nn.Module, rnd: int) -> None:
        super().on_round_start(model, rnd)
        model.phase = self.phase(rnd)  # type: ignore[assignment]

    def local_phase_update(self, model, store, client, gen):
        """Phase 1: the single-branch model g_p(f_p(x)) trains on the client's data; psi_c and omega_c stay in its store."""
        model.load_state_dict(store, strict=False)
        loss = train_local(model, client, self.train, gen, params=local_branch_parameters(model))
        sd = model.state_dict()
        for k in self.private:
            store[k] = sd[k].detach().clone()
        return loss

    def phase_one_upload(self, model, store):
        """Round E0: the client clones psi_c* into its shared branch (what of it is not aggregated, BatchNorm
        statistics with share_bn_stats: false, stays the client's own clone) and uploads psi_c* under phi's names:
        the input of Eq. 6."""
        phi = psi_as_phi(model.state_dict())
        for k in self.private:
            if k.startswith(SHARED):
                store[k] = phi[k].detach().clone()
        return {k: phi[k].detach() for k in self.shared}

    # Phase 2 (Eq. 7-8) is partial sharing: phi, psi_c and omega_c train together, phi alone is uploaded and averaged

    # ------------------------------------------------------------------ evaluation: each client's own dual-branch model
    def global_state(self, server):
        return None

    def eval_is_global(self):
        return False

