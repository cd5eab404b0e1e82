"""New-client onboarding (pFedDB Fig. 6): a domain held out of the federation joins after training.

The newcomer first has a pre-existing local model: the single-branch model (private extractor + head) trained on its
own data for ``pretrain_rounds`` rounds, exactly a pFedDB client's Phase 1 (the method's own ``local_phase_update``)
but at a constant learning rate: ``train.lr_schedule`` counts the federation's rounds, which a newcomer's are not.
It then downloads the global shared branch phi once and adapts for ``rounds`` rounds with each strategy, evaluated on
its test split after every round:

- ``freeze_global``: the shared branch takes phi and stays frozen; only psi_c, the fusion and the head train (what
  of the shared branch phi does not carry, its BatchNorm layers by default (``share_bn_affine``, ``share_bn_stats``),
  starts from the newcomer's own extractor, as a pFedDB client's does at the start of Phase 2; the statistics follow
  its data);
- ``finetune_all``: the same start, every block trains;
- ``from_scratch``: a freshly initialised dual-branch model trains on the newcomer's data alone (no phi, no
  pre-existing model).

Every strategy trains with Phase 2's settings (``phase2_optimizer`` / ``phase2_lr``: a newcomer holding phi trains as
a Phase-2 client does) and the same seeded batch order; the pre-existing local model with Phase 1's (it is a Phase-1
client). The run's seed seeds what pFedDB draws itself (``weight_init: authors``, ``branch_init: independent``); the
from_scratch model is drawn from another seed. Under freeze_global, phi stays as downloaded: where phi holds the
shared branch's BatchNorm statistics (``share_bn_stats``), they are frozen too (batches are still normalized by their
own statistics in training).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any, Callable, Optional, Sequence

from torch import nn

from fedsilo.client.data import ClientData, to_float
from fedsilo.client.local import evaluate, make_generator, running_stats_frozen, train_local
from fedsilo.methods.base import State, payload_bytes
from fedsilo.methods.pfeddb.method import PFedDB
from fedsilo.methods.pfeddb.model import SHARED, psi_as_phi
from fedsilo.models import LayeredNet

STRATEGIES = ("freeze_global", "finetune_all", "from_scratch")


def onboard_newcomer(
    method: PFedDB,
    backbone: Callable[[int], LayeredNet],
    client: ClientData,
    phi: State,
    pretrain_rounds: int,
    rounds: int,
    seed: int,
    strategies: Sequence[str] = STRATEGIES,
    on_round: Optional[Callable[[str, int, float], None]] = None,
) -> dict[str, Any]:
    """Run ``strategies`` (default all three, in STRATEGIES' order) for the newcomer ``client``;
    ``backbone(init_seed)`` builds a fresh backbone on the client's device, ``phi`` is the trained global shared
    branch; ``on_round(strategy, round, accuracy)`` hears of each adaptation round. Returns the per-round accuracy of
    each strategy, the pre-existing model's accuracy, the bytes the newcomer downloads (phi, once), and under
    ``models`` each strategy's adapted model and, as ``local``, the pre-existing local model (states, on the CPU)."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"onboarding strategies: {unknown or 'none'} (known: {', '.join(STRATEGIES)})")
    train = method.phase_train(2)  # the newcomer holding phi trains as a Phase-2 client
    example = to_float(client.x_train[:2], train.normalize)
    frozen_stats = any("running_" in k for k in phi)  # phi holds the shared branch's BatchNorm statistics

    method.run_seed = int(seed)  # the run's: what the method draws itself is seeded from it, as in the federation

    def dual(init_seed: int) -> nn.Module:
        device = client.x_train.device
        method.run_seed = int(init_seed)  # what pFedDB draws itself (authors' init, an independent shared branch)
        try:
            return method.transform_model(backbone(init_seed).to(device), example).to(device)
        finally:
            method.run_seed = int(seed)

    def adapt(strategy: str, model: nn.Module, trainable: Callable[[nn.Module], list[nn.Parameter]]) -> list[float]:
        accs = []
        for r in range(1, rounds + 1):
            gen = make_generator(seed, pretrain_rounds + r, client.index)
            with running_stats_frozen(model.shared) if strategy == "freeze_global" and frozen_stats else nullcontext():
                train_local(model, client, train, gen, params=trainable(model))
            accs.append(evaluate(model, client.x_test, client.y_test, cfg=train)["acc"])
            if on_round is not None:
                on_round(strategy, r, accs[-1])
        models[strategy] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        return accs

    models: dict[str, State] = {}

    # the newcomer's pre-existing local model: Phase 1 of pFedDB on its own data
    local = dual(seed)
    method.setup(local)
    store = method.init_client(local, client)
    local.phase = 1
    for r in range(1, pretrain_rounds + 1):
        method.local_phase_update(local, store, client, make_generator(seed, r, client.index))
    pre_acc = evaluate(local, client.x_test, client.y_test, cfg=train)["acc"] if pretrain_rounds else None
    models["local"] = {k: v.detach().cpu().clone() for k, v in local.state_dict().items()}
    joined = local.state_dict()
    joined.update(psi_as_phi(joined))  # the shared branch starts as the newcomer's own psi (what phi lacks stays so)
    joined.update(phi)  # and takes the downloaded phi

    curves: dict[str, list[float]] = {}
    for strategy in [s for s in STRATEGIES if s in strategies]:  # a strategy's numbers do not depend on the others run
        if strategy == "from_scratch":
            model = dual(seed + 7919)
            model.phase = 2
            curves[strategy] = adapt(strategy, model, lambda m: list(m.parameters()))
            continue
        model = copy.deepcopy(local)
        model.load_state_dict(joined, strict=True)
        model.phase = 2
        if strategy == "freeze_global":
            curves[strategy] = adapt(strategy, model, lambda m: [p for n, p in m.named_parameters() if not n.startswith(SHARED)])
        else:
            curves[strategy] = adapt(strategy, model, lambda m: list(m.parameters()))
    return {
        "pretrained_local_acc": pre_acc,
        "bytes_down_phi": payload_bytes(phi),
        "accuracy_per_round": curves,
        "final": {s: c[-1] for s, c in curves.items()},
        "models": models,
    }


def global_shared_branch(server: State) -> State:
    """phi from a trained pFedDB run's server state."""
    return {k: v for k, v in server.items() if k.startswith(SHARED)}


__all__ = ["STRATEGIES", "global_shared_branch", "onboard_newcomer"]
