"""pFedDB's onboarding of a newcomer (Fig. 6): a domain that took no part in the federation adapts a trained pFedDB.

- :func:`run_onboarding`, the onboard stage: the experiment's split must be ``holdout_domain`` with ``role:
  newcomer``; pFedDB must have been trained on it (its ``final_model.pt`` holds the global shared branch phi).
  Output: ``<results>/<experiment>/onboarding/seed<k>/onboarding.json`` (accuracy per round and strategy, the final
  accuracies, the bytes the newcomer downloads: phi once).
- :func:`onboard_site`, ``fedsilo site onboard``: a hospital that was not part of a deployed pFedDB run adapts the
  run's phi (the coordinator's ``final_model.pt``) on its own data, with its own params file, harmonize and split,
  and keeps the adapted model as a deployed site keeps its own (``model.pt``: ``fedsilo site predict`` and
  ``evaluate`` take it).

The strategies themselves are pFedDB's (:mod:`fedsilo.methods.pfeddb.onboarding`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from fedsilo.client.data import load_clients, pick_device
from fedsilo.config import ConfigError, Params
from fedsilo.methods import resolve_method
from fedsilo.methods.pfeddb import PFedDB
from fedsilo.methods.pfeddb.onboarding import STRATEGIES, global_shared_branch, onboard_newcomer
from fedsilo.models import build_model
from fedsilo.utils.io import atomic_dir, read_json, write_json

__all__ = ["STRATEGIES", "onboard_site", "run_onboarding"]


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
    res.pop("models")  # the stage reports the curves (Fig. 6); a site keeps its model (`fedsilo site onboard`)
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


def onboard_site(params: Params, experiment: str, root: Path, model_path: Path, strategies: Sequence[str] = ("freeze_global",),
                 out: Optional[Path] = None, quiet: bool = False) -> tuple[dict[str, Any], Path]:
    """A newcomer hospital adapts a deployed pFedDB run's phi on its own one-client ``experiment`` (its own params
    file under ``root``): its pre-existing local model first (``experiments.<e>.onboarding.pretrain_rounds`` rounds
    of pFedDB's Phase 1 on its data), then ``onboarding.rounds`` rounds of each of ``strategies``, with the
    deployment's training settings and seed, on the device its own params name (``experiments.<e>.train.device``),
    scored on its test split after each round. It downloads phi only (the server state's shared branch) and sends
    nothing. Writes ``model.pt`` (the first strategy's adapted model, in the form a deployed site keeps its model)
    and ``onboarding.json`` into ``out`` (default ``onboarding/<federation>/<method>/seed<k>`` under ``root``);
    returns the summary and the folder."""
    from fedsilo.fl.deploy import deployment_spec
    from fedsilo.fl.site import contract_mismatch, load_site, site_card
    from fedsilo.utils.io import canonical_hash
    from fedsilo.utils.progress import Progress

    root = Path(root)
    if experiment not in params.experiments:
        raise ConfigError(f"experiments.{experiment}: not defined in the site's params file")
    try:
        kept = torch.load(Path(model_path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"--model: {model_path}: no such file") from None
    except Exception as err:  # noqa: BLE001 - any unreadable file: say which and why, one line
        raise ConfigError(f"--model: {model_path}: not a model file torch can read ({type(err).__name__}: {err})") from None
    if not isinstance(kept, dict) or "deployment" not in kept or "server" not in kept:
        raise ConfigError(f"--model: {model_path}: not a deployment's final model (the coordinator's final_model.pt, beside "
                          "its metrics.json)")
    dep = kept["deployment"]
    try:
        spec = deployment_spec(dep)
        key = str(dep["method"]["key"])
    except (KeyError, TypeError, ValueError) as err:  # a hand-edited or truncated deployment record
        raise ConfigError(f"--model: {model_path}: its deployment record is not one fedsilo wrote ({type(err).__name__}: {err})") from None
    if not issubclass(spec.method_cls, PFedDB):
        raise ConfigError(f"--model: {model_path}: the deployment trained {key} ({dep['method']['base']}); onboarding adapts "
                          "pFedDB's global shared branch (its Fig. 6), so it needs a pFedDB deployment")
    card = site_card(params, experiment, root)  # the arrays hashed anew: a file changed after harmonize is refused
    if "tasks" in card:
        raise ConfigError(f"experiments.{experiment}.split: a stream of tasks; onboarding adapts to one static client")
    why = contract_mismatch(dep["contract"], card["contract"])
    if why:
        raise ConfigError(f"experiments.{experiment}: this site's data does not fit the deployment's contract: {'; '.join(why)}")
    members = [str(s["name"]) for s in dep["sites"]]
    if card["site"] in members:
        raise ConfigError(f"site {card['site']} took part in the deployment {dep['federation']}: it keeps its own model from "
                          "it (`fedsilo site audit` lists it); onboarding is for a hospital that did not")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies or len(set(strategies)) != len(strategies):
        raise ConfigError(f"--strategy: {', '.join(strategies) or 'none'}: name each of {', '.join(STRATEGIES)} at most once")
    exp = params.experiments[experiment]
    ob = exp.onboarding
    device = pick_device(exp.train.device, f"experiments.{experiment}.train.device")
    client = load_site(params, experiment, root, device, index=len(members))  # its own stream of seeded randomness
    assert not isinstance(client, list)
    h, _, ch = (int(v) for v in dep["contract"]["image_shape"])
    n_cls = len(dep["contract"]["classes"])
    phi = {k: v.to(device) for k, v in global_shared_branch(kept["server"]).items()}

    def backbone(init_seed: int):
        return build_model(spec.train.model, ch, n_cls, seed=init_seed, image_size=h, width=spec.train.model_width)

    with Progress(len(strategies) * ob.rounds, f"onboard {card['site']}", "round", quiet=quiet) as bar:
        res = onboard_newcomer(spec.method(), backbone, client, phi, ob.pretrain_rounds, ob.rounds, spec.seed, strategies,
                               on_round=lambda s, r, acc: bar.update(1, f"{s} round {r}: test acc {acc:.3f}", line=r == ob.rounds))
    models = res.pop("models")
    keep = strategies[0]
    summary = {
        "site": card["site"],
        "fingerprint": card["fingerprint"],
        "federation": dep["federation"],
        "method": key,
        "seed": spec.seed,
        "deployment_sha256": canonical_hash(dep),
        "from_model": str(model_path),
        "server_round": int(kept.get("round", 0)),
        "strategies": [s for s in STRATEGIES if s in strategies],
        "kept": keep,
        "pretrain_rounds": ob.pretrain_rounds,
        "rounds": ob.rounds,
        **res,
    }
    out = Path(out) if out is not None else root / "onboarding" / str(dep["federation"]) / key / f"seed{spec.seed}"
    with atomic_dir(out) as tmp:
        torch.save({"site": card["site"], "round": ob.rounds, "deployment": dep, "onboarding": {k: summary[k] for k in (
            "strategies", "kept", "pretrain_rounds", "rounds", "server_round", "from_model")}, "model": models[keep]}, tmp / "model.pt")
        os.chmod(tmp / "model.pt", 0o600)  # trained on the site's images: as a deployed site keeps its model
        write_json(tmp / "onboarding.json", summary)
    return summary, out
