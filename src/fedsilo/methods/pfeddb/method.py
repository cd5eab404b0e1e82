"""pFedDB (Pang, Ni, Zhong, AAAI 2026): the dual-branch model (``model.py``) under the two-phase protocol.

Protocol (Algorithm 1):
- Phase 1, rounds 1..E0 (``local_rounds``): every client trains the single-branch model g_p(f_p(x)) on its own data;
  nothing is sent. In round E0 every client (all of them, Eq. 6 sums over S) uploads its trained extractor psi_c*
  once, as the initial value of phi, and the server sets phi(0) = sum_c n_c / n psi_c* (Eq. 6).
- Phase 2, rounds E0+1..T: the server broadcasts phi to the sampled clients; each trains phi, psi_c and omega_c
  together (Eq. 7) and uploads phi only; the server takes the sample-size-weighted mean (Eq. 8). psi_c and omega_c
  never leave the client.
- ``two_phase: false`` (Table 4 ablation): the dual-branch model is trained federatedly from round 1. Its two
  extractors start from independent random draws (``branch_init: independent``, the default), as the authors' model
  classes initialise them (``nets/models.py`` on the dev branch of github.com/yiranpang/pFedDB: ``AlexNet_DB``'s and
  ``DenseNet_DB``'s branches are separate modules, each drawn by ``_init_weights``): f_s is the first l_c layers of a
  second backbone drawn with the run's architecture and a seed derived from the run's seed. ``branch_init: same``
  starts phi and psi as copies of one draw. Under the two-phase protocol the
  switch does nothing: phi starts as the clone of psi_c* (the same in the authors' code: ``copy_single_to_dual``).
  ``weight_init: authors`` (one-phase only) draws the whole dual-branch model as those classes' ``_init_weights``
  do (:func:`~fedsilo.methods.pfeddb.model.authors_init`: convolutions Kaiming normal, fan_out for the Digits and
  AlexNet classes and fan_in for DenseNet's, linear layers N(0, 0.01), BatchNorm 1 and 0), each branch its own draw;
  ``backbone`` (default) keeps the backbone's initialisation (torch's defaults for AlexNet-BN and Simple-CNN, as the
  authors' single-branch ``DigitModel`` and ``AlexNet``).

Where the authors' code (dev branch of github.com/yiranpang/pFedDB) fixes what the paper leaves open, the paper preset
(``pipelines/pfeddb/paper/params.yaml``) follows it:
- Optimizers (``phase1_optimizer``/``phase1_lr``, ``phase2_optimizer``/``phase2_lr``, from :class:`TwoPhaseParams`):
  ``federated/fed_digits_twophase.py`` trains Phase 1 with ``optim.SGD(lr=1e-2)`` (no momentum, no weight decay) and
  Phase 2 with ``optim.Adam(lr=1e-2)`` (torch's betas), a new Adam for every client in every round. The paper says only
  "SGD optimizer with a learning rate of 10^-2" (for the compared methods). The defaults (null) train both phases
  with ``train``'s optimizer. That script is the authors' only two-phase training script (Digits): Office-Caltech-10's
  ``fed_office.py`` is FedBN's (SGD 1e-2, no two-phase mode), DomainNet has no pFedDB script either, and
  Chest-X-Ray-4 has an evaluation script only, so the preset takes Adam for Simple-CNN (Digits) and the paper's SGD
  1e-2 for AlexNet-BN (Office-Caltech-10, DomainNet) and DenseNet-121 (values per backbone). Adam's first step
  moves every weight by about lr, a multiple of AlexNet's fully connected weights at their initialisation: on the
  real Office images Phase 2's first round took the loss from 0.003 to 8-17 and the run ended 20 points below the
  paper (docs/results/2026-11-28-acceptance-a-rest-h200/).
- What phi carries (``share_bn_affine``, ``share_bn_stats``): ``aggregate_shared`` in the same script averages the
  shared branch's weights and biases and skips every key containing ``bn`` or ``running_`` or
  ``num_batches_tracked``: no BatchNorm tensor of the shared branch is averaged, its affine weight and bias included.
  Both switches default to that rule. BatchNorm tensors are found by module type, so DenseNet's ``norm*`` layers are
  covered as well as Simple-CNN's and AlexNet's.
- Not followed (noted for the reader): in that script Phase 2's first round trains from each client's own psi_c*
  clone and averages afterwards, where Eq. 6 averages first (we follow Eq. 6); Phase 1 starts each client from its
  own ``DigitModel()`` draw, where we start every client from the run's one seeded draw; and ``DigitModel_DB`` builds
  ``shared_conv`` and ``local_conv`` from the same module objects, so on Digits its two convolutional branches are one
  (tied) module and only the projections ``shared_proj``/``local_proj`` are separate branches. ``AlexNet_DB`` and the
  DenseNet dual-branch classes have separate branches, as here.

A site that joins a run in progress (``joinable``; a deployment's ``sites[k].joined``) first trains, on its own, the
Phase-1 rounds it missed (``local_phase_update`` for each, drawing its batches and augmentation as it would have in
those rounds, at their learning rates), so it holds the local model it would hold had it been there from round 1
(Phase 1 sends nothing, so nothing of the others' is needed). Joining in Phase 1, it then trains on with the rest and
its psi_c* is in Eq. 6's mean. Joining in Phase 2, Eq. 6's mean is made: its shared branch takes phi as every
site's does and its psi_c* clone keeps what of the shared branch is not aggregated (as at round E0), the newcomer of
the paper's Fig. 6 that goes on training with the federation. The server keeps, per site, the last Phase-1 round its
local model holds (``pfeddb:local_model::<site>``, bookkeeping never sent) and adds the rounds to catch up (two
integers, ``pfeddb:catch_up``: first and last round) to the download of a site behind; the paper has no late site.
A site that was away (a deployment's ``left``, then back) in Phase-1 rounds catches up the same way (``catches_up``).

Choices where the paper is open:
- Phase-1 length is counted in rounds of E local epochs, like the paper's "150 rounds of local training" out of 300.
- The paper's "cut depth" counts weighted layers (convolutions and linear layers) as our backbones do: AlexNet
  l_c = 6 shares 71 % of the parameters, DenseNet-121 l_c = 88 (after transition 3) 68-69 %, as in Table 3. A cut
  at the last layer (AlexNet l_c = 8, "Ratio 1.00") leaves an identity head: the fused logits are the output.
- ``cut_depth: null`` picks the unit boundary whose shared fraction is closest to 70 %, the paper's recommendation.
- Evaluation during Phase 1 uses the single-branch local model, afterwards the client's dual-branch model.
- The Phase-1 -> Phase-2 transition sends psi_c* once under phi's names; this is the upload Eq. 6 requires, and it
  is counted in that round's bytes.
- phi is "the parameters of the shared branch"; with the authors' rule (above) its BatchNorm layers stay with the
  client (each client starts them from its own psi_c* clone). ``share_bn_affine: true`` uploads and averages their
  affine weight and bias, ``share_bn_stats: true`` their running statistics. On the CXR mirrors averaging the
  statistics cost 5-7 points of mean accuracy (16 images per client, 14 rounds, two seeds: 0.79 vs 0.86), the FedBN
  effect inside the shared branch.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from pydantic import Field, PositiveInt, model_validator
from pydantic_core import PydanticCustomError
from torch import nn

from fedsilo.client.local import make_generator, scheduled_lr, train_local
from fedsilo.config import ConfigError
from fedsilo.methods.base import State, TakenMean, per_backbone_type
from fedsilo.methods.pfeddb.model import (
    SHARED,
    DualBranch,
    authors_init,
    closest_to_70,
    local_branch_parameters,
    psi_as_phi,
    shared_batchnorm_keys,
    shared_fraction,
)
from fedsilo.methods.phased import TwoPhase, TwoPhaseParams
from fedsilo.methods.sharing import per_backbone
from fedsilo.models import LayeredNet, build_model

# the keys (after the run's seed) of the independent shared-branch draw and of the authors' initialisation: round 0,
# which no training round uses, and a tag no client index reaches (make_generator pads keys with zeros, so a bare
# (seed, 2) would draw what round 2's client 0 draws)
BRANCH_KEYS = (0, 2_000_003)
INIT_KEYS = (0, 3_000_017)
# the server's record, per site (+ its name), of the last Phase-1 round the site's local model holds; bookkeeping,
# never sent
LOCAL_MODEL = "pfeddb:local_model::"
# in the download of a site behind (one that joined the run in progress, or came back after Phase-1 rounds it was
# gone for): the first and last Phase-1 round it is to train on its own before the round's work
CATCH_UP = "pfeddb:catch_up"


class PFedDBParams(TwoPhaseParams):
    cut_depth: per_backbone_type(Optional[PositiveInt]) = Field(
        None,
        description="l_c in weighted layers; a mapping backbone -> l_c (one methods block serving several backbones, "
        "e.g. {densenet121: 88, alexnet_bn: 6}; a backbone trained needs its entry); null = closest to 70 % shared",
    )
    local_rounds: int = Field(150, ge=0, description="E0: Phase-1 rounds of local training")
    two_phase: bool = True
    fusion: Literal["add", "concat", "attention", "weighted"] = "add"
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="weight of the shared branch for fusion=weighted")
    share_bn_stats: bool = Field(
        False, description="also upload and average the shared branch's BatchNorm running statistics (the authors' "
        "code: no)",
    )
    share_bn_affine: bool = Field(
        False, description="also upload and average the shared branch's BatchNorm affine weight and bias (the "
        "authors' code: no BatchNorm tensor of the shared branch is averaged)",
    )
    weight_init: Literal["backbone", "authors"] = Field(
        "backbone", description="two_phase: false only: the dual-branch model keeps the backbone's own initialisation "
        "(backbone) or is drawn as the authors' dual-branch classes draw themselves (authors: convolutions Kaiming "
        "normal, linear layers N(0, 0.01), BatchNorm 1 and 0)",
    )
    branch_init: Literal["independent", "same"] = Field(
        "independent", description="two_phase: false only: the shared and private extractors start from independent "
        "random draws (the authors' model classes) or from the same one",
    )

    def unused_keys(self) -> set[str]:
        one = {"weight_init", "branch_init"}  # the one-phase run's initialisation
        return {"local_rounds", "phase1_optimizer", "phase1_lr"} if not self.two_phase else one

    @model_validator(mode="after")
    def _authors_init_is_one_phase(self) -> "PFedDBParams":
        if self.weight_init == "authors" and self.two_phase:
            raise PydanticCustomError("one_phase_only", "authors applies to two_phase: false (under the two-phase protocol the "
                                      "model starts from Phase 1's, itself the backbone's draw)", {"field": "weight_init"})
        return self


class PFedDB(TwoPhase):
    name = "pfeddb"
    params_cls = PFedDBParams
    params: PFedDBParams
    joinable = True  # a site joining later trains the Phase-1 rounds it missed first (the server says which)
    catches_up = True  # and so does a site back after Phase-1 rounds it was gone for

    # ------------------------------------------------------------------ model
    def transform_model(self, model: nn.Module, example: torch.Tensor) -> nn.Module:
        """The backbone becomes f_s, f_p, fusion and g_p, cut after l_c weighted layers."""
        if not isinstance(model, LayeredNet):
            raise TypeError("pfeddb needs a LayeredNet backbone")
        depth = per_backbone(self.params.cut_depth, self.train.model, f"methods.{self.key}.cut_depth")
        depth = closest_to_70(model) if depth is None else depth
        if depth > model.num_layers:
            raise ConfigError(f"methods.{self.key}.cut_depth: {depth} exceeds the backbone's {model.num_layers} layers")
        self.cut_depth = depth
        self.backbone_shared_fraction = shared_fraction(model, depth)
        # weight_init: authors draws both branches itself; the backbone's second draw would only be overwritten
        independent = not self.params.two_phase and self.params.branch_init == "independent" and self.params.weight_init == "backbone"
        shared_from = self.independent_draw(model, example) if independent else None
        net = DualBranch(model, model.cut_index(depth), self.params.fusion, self.params.alpha, example, shared_from)
        if self.params.weight_init == "authors":
            authors_init(net, make_generator(self.run_seed, *INIT_KEYS), "fan_in" if self.train.model == "densenet121" else "fan_out")
            if self.params.branch_init == "same":
                net.shared.load_state_dict(net.private.state_dict())
        return net

    def independent_draw(self, model: LayeredNet, example: torch.Tensor) -> LayeredNet:
        """A second backbone of the run's architecture (``train.model``), drawn by the backbone's own initialisation
        with a seed derived from (run seed, BRANCH_KEYS); the global random state is left as it was."""
        was = model.training
        model.eval()
        with torch.no_grad():
            num_classes = int(model(example).shape[-1])
        model.train(was)
        seed = int(make_generator(self.run_seed, *BRANCH_KEYS).initial_seed())
        cuda = [example.device.index or 0] if example.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            other = build_model(self.train.model, example.shape[1], num_classes, seed=seed, image_size=example.shape[-1],
                                width=self.train.model_width)
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        if {k: v.shape for k, v in other.state_dict().items()} != shapes:
            raise ConfigError(
                f"methods.{self.key}.branch_init: independent draws the shared branch from a fresh {self.train.model}, "
                "and the backbone being trained is not one; use branch_init: same"
            )
        return other.to(example.device)

    def shared_keys(self, model) -> list[str]:
        """phi: the shared branch's weights and biases; its BatchNorm affine parameters with share_bn_affine, its
        BatchNorm statistics with share_bn_stats (BatchNorm layers found by module type)."""
        affine, stats = shared_batchnorm_keys(model)
        kept = (set() if self.params.share_bn_affine else affine) | (set() if self.params.share_bn_stats else stats)
        return [k for k in model.state_dict() if k.startswith(SHARED) and k not in kept]

    def phase_one_rounds(self) -> int:
        return self.params.local_rounds if self.params.two_phase else 0

    def resolved(self) -> dict[str, Any]:
        out = super().resolved()
        if hasattr(self, "cut_depth"):
            out.update(cut_depth=self.cut_depth, backbone_shared_fraction=round(self.backbone_shared_fraction, 6))
        out.update(self.phase_optimizers())
        return out

    # ------------------------------------------------------------------ protocol
    def on_round_start(self, model: nn.Module, rnd: int) -> None:
        super().on_round_start(model, rnd)
        model.phase = self.phase(rnd)  # type: ignore[assignment]

    def local_phase_update(self, model, store, client, gen):
        """Phase 1: the single-branch model g_p(f_p(x)) trains on the client's data; psi_c and omega_c stay in its store."""
        model.load_state_dict(store, strict=False)
        loss = train_local(model, client, self.phase_train(1), gen, params=local_branch_parameters(model))
        sd = model.state_dict()
        for k in self.private:
            store[k] = sd[k].detach().clone()
        return loss

    def phase_one_upload(self, model, store):
        """Round E0: the client keeps psi_c* (:meth:`keep_phase_one`) and uploads it under phi's names: the input of
        Eq. 6."""
        phi = self.keep_phase_one(model, store)
        return {k: phi[k].detach() for k in self.shared}

    def keep_phase_one(self, model, store) -> State:
        """The end of a site's Phase 1: it clones psi_c* into its shared branch (what of it is not aggregated,
        BatchNorm statistics with share_bn_stats: false, stays the site's own clone); returns psi_c* under phi's
        names."""
        phi = psi_as_phi(model.state_dict())
        for k in self.private:
            if k.startswith(SHARED):
                store[k] = phi[k].detach().clone()
        return phi

    # Phase 2 (Eq. 7-8) is partial sharing: phi, psi_c and omega_c train together, phi alone is uploaded and averaged

    # ------------------------------------------------------------------ a site that joins a run in progress
    def download(self, server, client, rnd):
        """phi in Phase 2 (nothing in Phase 1), and for a site whose local model is behind Phase 1's rounds so far
        (it joined the run in progress) the rounds it is to train first."""
        out = {} if self.phase(rnd) == 1 else {k: server[k] for k in self.shared}
        have = int(server[LOCAL_MODEL + client.name]) if LOCAL_MODEL + client.name in server else 0
        want = min(rnd - 1, self.e0)
        if want > have:
            out[CATCH_UP] = torch.tensor([have + 1, want], dtype=torch.int64)
        return out

    def local_update(self, model, store, payload, client, rnd, seed):
        span = payload.get(CATCH_UP)
        if span is not None:
            first, last = (int(v) for v in span.flatten().tolist()) if span.numel() == 2 else (0, -1)
            if not 1 <= first <= last <= min(rnd - 1, self.e0):  # a site trains no round twice, none to come
                raise ValueError(f"{client.name}: the server asked round {rnd} to train Phase-1 rounds {span.tolist()} first; "
                                 f"a site catches up a span of rounds 1 to {min(rnd - 1, self.e0)} only")
            self.catch_up(model, store, client, first, last, rnd, seed)
            payload = {k: v for k, v in payload.items() if k != CATCH_UP}
        return super().local_update(model, store, payload, client, rnd, seed)

    def catch_up(self, model, store, client, first: int, last: int, rnd: int, seed: int) -> None:
        """Phase-1 rounds ``first``..``last`` of a site that joined later (or was away), trained as it would have trained them
        (each round's batches, augmentation and learning rate); past round E0 it then keeps psi_c* as every site did
        at E0 (its upload, Eq. 6's input, is no longer wanted)."""
        was = getattr(model, "phase", 1)
        model.phase = 1  # type: ignore[assignment]
        try:
            for j in range(first, last + 1):
                with scheduled_lr(self.train, j):
                    self.local_phase_update(model, store, client, make_generator(seed, j, client.index))
        finally:
            model.phase = was  # type: ignore[assignment]
        if last == self.e0 and rnd > self.e0:
            self.keep_phase_one(model, store)

    def agg_begin(self, server: State, rnd: int) -> TakenMean:
        return TakenMean()

    def agg_add(self, acc: TakenMean, client, upload: State) -> None:
        super().agg_add(acc, client, upload)
        acc.took.append(client.name)

    def agg_end(self, server, acc, rnd):
        """phi: the mean of the round's uploads (Eq. 6 at round E0, Eq. 8 after; none in Phase 1's other rounds);
        each site that trained now holds a local model of Phase-1 round min(rnd, E0)."""
        out = {**server, **(acc.result() if acc.weight > 0 and self.shared else {})}
        if self.e0:  # one phase (two_phase: false): no local model to record
            out.update({LOCAL_MODEL + name: torch.tensor(min(rnd, self.e0), dtype=torch.int64) for name in acc.took})
        return out

    # ------------------------------------------------------------------ evaluation: each client's own dual-branch model
    def global_state(self, server):
        return None

    def eval_download(self, server: State, client) -> State:
        """phi only: the server's records of the sites stay on the server."""
        return {k: server[k] for k in self.shared}

    def eval_is_global(self):
        return False

    def newcomer_refusal(self) -> str:
        """A newcomer adapts through pFedDB's own onboarding (`fedsilo site onboard` with a Fig. 6 strategy), not as
        one of its sites."""
        return ("pFedDB's newcomer adapts as its paper's Fig. 6 does (its own local model first, then phi: "
                "freeze_global, finetune_all, from_scratch)")
