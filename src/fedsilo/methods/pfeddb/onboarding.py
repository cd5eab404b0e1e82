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

Every strategy uses the experiment's training settings and the same seeded batch order.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence

from torch import nn

from fedsilo.client.data import ClientData, to_float
from fedsilo.client.local import evaluate, make_generator, train_local
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
    ``models`` each strategy's adapted model (its state, on the CPU)."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"onboarding strategies: {unknown or 'none'} (known: {', '.join(STRATEGIES)})")
    train = method.train
    example = to_float(client.x_train[:2])

    def dual(init_seed: int) -> nn.Module:
        device = client.x_train.device
        return method.transform_model(backbone(init_seed).to(device), example).to(device)

    def adapt(strategy: str, model: nn.Module, trainable: Callable[[nn.Module], list[nn.Parameter]]) -> list[float]:
        accs = []
        for r in range(1, rounds + 1):
            train_local(model, client, train, make_generator(seed, pretrain_rounds + r, client.index), params=trainable(model))
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
