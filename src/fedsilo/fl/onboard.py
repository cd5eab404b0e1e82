"""The onboard stage (pFedDB Fig. 6): a domain held out of the federation joins a trained pFedDB run.

The experiment's split must be ``holdout_domain`` with ``role: newcomer``; pFedDB must have been trained on it (its
``final_model.pt`` holds the global shared branch phi). The strategies themselves are pFedDB's
(:mod:`fedsilo.methods.pfeddb.onboarding`). Output: ``<results>/<experiment>/onboarding/seed<k>/onboarding.json``
(accuracy per round and strategy, the final accuracies, the bytes the newcomer downloads: phi once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedsilo.client.data import load_clients, pick_device
from fedsilo.config import ConfigError, Params
from fedsilo.methods import resolve_method
from fedsilo.methods.pfeddb import PFedDB
from fedsilo.methods.pfeddb.onboarding import STRATEGIES, global_shared_branch, onboard_newcomer
from fedsilo.models import build_model
from fedsilo.utils.io import atomic_dir, read_json, write_json

__all__ = ["STRATEGIES", "run_onboarding"]


def run_onboarding(params: Params, experiment: str, seed: int, root: Path = Path("."), method: str = "pfeddb") -> dict[str, Any]:
    root = Path(root)
    exp = params.experiments[experiment]
    if exp.split.protocol != "holdout_domain" or exp.split.role != "newcomer":
        raise ConfigError(f"experiments.{experiment}.split: onboarding needs protocol holdout_domain with role newcomer")
    algo = resolve_method(params, method, exp.train)
    if not isinstance(algo, PFedDB):
        raise ConfigError(f"methods.{method}: onboarding needs a pfeddb entry, not {algo.name}")
    layout = params.layout(root)
    split = read_json(layout.split(experiment))
    final = layout.run(experiment, method, seed) / "final_model.pt"
    if not final.exists():
        raise FileNotFoundError(f"{final}: missing; train {experiment} / {method} / seed {seed} first (`dvc repro`)")
    ob = exp.onboarding
    device = pick_device(exp.train.device, f"experiments.{experiment}.train.device")
    newcomer_split = {"clients": [split["holdout"]["client"]], "num_classes": split["num_classes"]}
    (client,), in_ch, num_classes = load_clients(layout.harmonized(exp.dataset), newcomer_split, device)
    client.index = len(split["clients"])  # its own stream of seeded randomness
    phi = global_shared_branch(torch.load(final, map_location=device, weights_only=False)["server"])

    def backbone(init_seed: int):
        return build_model(exp.train.model, in_ch, num_classes, seed=init_seed, image_size=client.x_train.shape[-1],
                           width=exp.train.model_width)

    res = onboard_newcomer(algo, backbone, client, phi, ob.pretrain_rounds, ob.rounds, seed)
    out = {
        "experiment": experiment,
        "seed": seed,
        "newcomer": split["holdout"]["domain"],
        "rounds": ob.rounds,
        "pretrain_rounds": ob.pretrain_rounds,
        **res,
    }
    with atomic_dir(layout.onboarding(experiment, seed)) as tmp:
        write_json(tmp / "onboarding.json", out)
    return out
