"""Onboarding of a newcomer: a domain or hospital that took no part in the federation adapts its trained model.

- :func:`run_onboarding`, the onboard stage: the experiment's split must be ``holdout_domain`` with ``role:
  newcomer``; pFedDB must have been trained on it (its ``final_model.pt`` holds the global shared branch phi).
  Output: ``<results>/<experiment>/onboarding/seed<k>/onboarding.json`` (accuracy per round and strategy, the final
  accuracies, the bytes the newcomer downloads: phi once).
- :func:`onboard_site`, ``fedsilo site onboard``: a hospital that was not part of a deployed run adapts the
  federation's model (the coordinator's ``final_model.pt``: pFedDB's phi, the shared tensors of a method whose
  model is the plain backbone, or what the server would send a site joining after the run: :func:`newcomer_rule`)
  on its own data, with its own params file, harmonize and split, and keeps the adapted model as a deployed site
  keeps its own (``model.pt``: ``fedsilo site predict`` and ``evaluate`` take it).

The strategies are pFedDB's Fig. 6 (:mod:`fedsilo.methods.pfeddb.onboarding`); :func:`adapt_federation_model` runs
them on a plain backbone; ``as_member`` (:func:`adapt_as_member`) runs the method's own client round against the
finished federation, for any method whose sites keep something of their own.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from fedsilo.client.data import ClientData, load_clients, pick_device, to_float
from fedsilo.client.local import evaluate, make_generator, running_stats_frozen, train_local
from fedsilo.config import ConfigError, Params
from fedsilo.config.errors import not_defined
from fedsilo.data.cards import data_record, refuse_changed_arrays
from fedsilo.data.splits import refuse_stale_split
from fedsilo.fl.deploy import NEWCOMER, OWN_PART, as_member_refusal, deployment_spec, read_model_file
from fedsilo.methods import resolve_method
from fedsilo.methods.base import State, payload_bytes
from fedsilo.methods.pfeddb import PFedDB
from fedsilo.methods.pfeddb.onboarding import STRATEGIES, global_shared_branch, onboard_newcomer
from fedsilo.models import build_model
from fedsilo.utils.io import atomic_dir, read_json, write_json

__all__ = ["MEMBER", "ONBOARD_STRATEGIES", "STRATEGIES", "onboard_site", "run_onboarding"]

MEMBER = "as_member"  # adapt as the method's own sites do (adapt_as_member)
ONBOARD_STRATEGIES = (*STRATEGIES, MEMBER)


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
    refuse_stale_split(split, exp.split, layout.split(experiment), experiment,
                       f"`dvc repro {params.stage_target(f'split@{experiment}')}`")
    final = layout.run(experiment, method, seed) / "final_model.pt"
    if not final.exists():
        raise FileNotFoundError(f"{final}: missing; train {experiment} / {method} / seed {seed} first (`dvc repro`)")
    ob = exp.onboarding
    device = pick_device(exp.train.device, f"experiments.{experiment}.train.device")
    harmonized = layout.harmonized(exp.dataset)
    card = read_json(harmonized / "card.json")  # the newcomer's images are the card's, as a run's are (fl/run.py)
    refuse_changed_arrays(harmonized, card, f"put them back with `dvc checkout harmonize@{exp.dataset}` or `dvc repro "
                          f"harmonize@{exp.dataset}`")
    newcomer_split = {"clients": [split["holdout"]["client"]], "num_classes": split["num_classes"]}
    (client,), in_ch, num_classes = load_clients(harmonized, newcomer_split, device)
    client.index = len(split["clients"])  # its own stream of seeded randomness
    trained = torch.load(final, map_location=device, weights_only=False)
    phi = global_shared_branch(trained["server"])

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
        # what the curves come from: the newcomer's arrays and split, and the federation's run (its metrics.json's)
        "data": data_record(card, layout.split(experiment)),
        "federation_config_hash": trained.get("config_hash"),
    }
    with atomic_dir(layout.onboarding(experiment, seed)) as tmp:
        write_json(tmp / "onboarding.json", out)
    return out


def newcomer_rule(dep: dict[str, Any], method: Any) -> str:
    """Which kind of method a hospital outside the deployment ``dep`` adapts (``method``: the deployment's method,
    built): ``own_part`` (its sites keep a part of the model, which its paper trains for a new client under the
    federation's: FedBN, FedRep, FedPer, LG-FedAvg), ``global`` (every site is evaluated with the federation's global
    model) or ``personal`` (each site is evaluated with a model its own training makes: Ditto's personal model,
    FedPAC's head, F²DC's modules, ...)."""
    if str(dep["method"]["base"]) in OWN_PART:
        return "own_part"
    return "global" if method.eval_is_global() else "personal"


# the strategy `fedsilo site onboard` runs without --strategy, per newcomer_rule (pFedDB: freeze_global, its Fig. 6)
DEFAULT_STRATEGY = {"own_part": "freeze_global", "global": "finetune_all", "personal": MEMBER}


def adapt_as_member(spec: Any, client: ClientData, newcomer: dict[str, Any], rounds: int,
                    on_round: Optional[Callable[[str, int, float], None]] = None) -> dict[str, Any]:
    """``as_member``: the newcomer adapts as one of the deployment's sites would in a federation that no longer moves.
    ``newcomer`` is what the server would send a site joining after the run's last round R (final_model.pt's
    :data:`~fedsilo.fl.deploy.NEWCOMER` entry: a round's download and an evaluation's). The site starts as every site
    did (the deployment's seed, ``Method.init_client``), then each of ``rounds`` rounds is the method's round R for it
    against that same download: ``Method.local_update`` (what it would upload is dropped: nothing is sent, the
    federation's model does not change), then ``Method.load_eval_model`` with the evaluation download, scored on its
    test split. So Ditto's newcomer trains its personal model towards the federation's global one, pFedSD's distils
    from its own last personal model, FedPAC's trains its head against the global prototypes, F²DC's its decoupler
    and corrector, pFedDR's its local BatchNorm; FedBABU's and FT-FedAvg's evaluation fine-tunes the federation's
    model, the same each round (their curve is flat). Where a site's evaluation model needs what the server makes
    from its uploads (FDSE, CD2-pFed, LG-FedAvg with ``fedavg_rounds``: ``Method.newcomer_refusal``), the deployment
    writes no newcomer download and this is refused before (:func:`~fedsilo.fl.deploy.as_member_refusal`). The rate is
    the train's, without ``train.lr_schedule`` (the schedule counts the federation's rounds, which a newcomer's are
    not; its last rounds' factor may be near 0), and round r's batches are drawn from (the deployment's seed, r).
    ``spec``: the deployment's FlowerSpec (:func:`~fedsilo.fl.deploy.deployment_spec`). Returns the accuracy per
    round, the final accuracy and the model it is evaluated with after the last round."""
    from fedsilo.fl.engine import read_only
    from fedsilo.fl.flower import Card

    device = client.x_train.device
    # to the method, the newcomer is the site the server made the downloads for (its index and name: a part the
    # server would make for it is keyed by them)
    client = copy.copy(client)
    client.index, client.name = int(newcomer["index"]), NEWCOMER
    method, model, _ = spec.build(to_float(client.x_train[:2], spec.train.normalize), device, [Card.of(client)])
    last = int(newcomer["round"])
    down = read_only({k: v.to(device) for k, v in newcomer["download"].items()})
    evaluation = read_only({k: v.to(device) for k, v in newcomer["eval"].items()})
    store = method.init_client(model, client)
    accs = []
    for r in range(1, rounds + 1):
        seed = int(make_generator(spec.seed, r, client.index, 11).initial_seed() % (1 << 31))
        torch.manual_seed(int(make_generator(spec.seed, r, client.index, 7).initial_seed()))  # whatever a model draws itself
        method.on_round_start(model, last)
        method.last_loss = None
        method.local_update(model, store, down, client, last, seed)  # its upload goes nowhere
        method.load_eval_model(model, evaluation, store, client, last)
        accs.append(evaluate(model, client.x_test, client.y_test, cfg=spec.train)["acc"])
        if on_round is not None:
            on_round(MEMBER, r, accs[-1])
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"pretrained_local_acc": None, "accuracy_per_round": {MEMBER: accs}, "final": {MEMBER: accs[-1]}, "models": {MEMBER: state}}


def adapt_federation_model(dep: dict[str, Any], client: ClientData, shared: State, rounds: int, strategies: Sequence[str],
                           on_round: Optional[Callable[[str, int, float], None]] = None) -> dict[str, Any]:
    """A newcomer of a deployed method other than pFedDB (:func:`newcomer_rule`): the model every site started from
    (the deployment's seed), the federation's ``shared`` tensors loaded into it, what each site keeps for itself left
    at that start; then ``rounds`` rounds of local training per strategy, with the deployment's training settings,
    scored on the client's test split after each:

    - ``freeze_global`` (a method whose sites keep a part): the shared tensors frozen (their BatchNorm statistics
      too), the site's own part trained: FedBN's BatchNorm, FedRep's and FedPer's head, LG-FedAvg's lower layers, as
      those papers adapt a new client;
    - ``finetune_all``: the same start, every tensor trained (for a global model: fine-tuning it);
    - ``from_scratch``: the backbone drawn from another seed, trained on the client's data alone.

    Returns the accuracy per round and final per strategy, and their models (states on the CPU)."""

    spec = deployment_spec(dep)
    seed = spec.seed
    example = to_float(client.x_train[:2], spec.train.normalize)
    device = client.x_train.device

    def start(init_seed: int) -> tuple[Any, nn.Module, set[str]]:
        method, model, private = deployment_spec({**dep, "seed": init_seed}).build(example, device, [])
        return method, model, set(private)

    method, base, private = start(seed)
    train = method.train  # the deployment's train, with the method's own local_optimizer settings where it has them
    plain = {k: v.shape for k, v in spec.make_model().state_dict().items()}
    if {k: v.shape for k, v in base.state_dict().items()} != plain:
        raise ConfigError(f"{dep['method']['key']} builds its own model around the backbone ({dep['method']['base']}: other "
                          "layers, branches or modes than the backbone's): onboarding adapts pFedDB's branches or a plain "
                          "backbone's tensors")
    if not shared:
        raise ConfigError(f"the federation's model of {dep['method']['key']} holds no whole tensor (its sites share slices of "
                          "tensors, as CD2-pFed's channels, or nothing): there is nothing to adapt from")
    model_keys = set(base.state_dict())
    if set(shared) - model_keys or (model_keys - set(shared)) - private:
        raise ConfigError(f"the federation's model holds other tensors than {dep['method']['key']} builds for a site: not a "
                          "final_model.pt of this deployment")
    rule, key = newcomer_rule(dep, method), str(dep["method"]["key"])
    if "freeze_global" in strategies and rule == "global":
        raise ConfigError(f"--strategy freeze_global: {key}'s sites keep no part of their own: its "
                          "federation's model is its global model (score with it as it is, `fedsilo site predict --model "
                          "final_model.pt`, or fine-tune it, --strategy finetune_all)")
    if "freeze_global" in strategies and rule == "personal":
        raise ConfigError(f"--strategy freeze_global: {key}'s sites are evaluated with a model their own training makes, "
                          f"not the federation's tensors with a part trained under them: adapt as its sites do (--strategy "
                          f"{MEMBER}), or fine-tune the federation's model (finetune_all)")
    if rule == "own_part" and dep["method"]["base"] == "lgfedavg" and int(dep["method"]["params"].get("fedavg_rounds") or 0) > 0:
        raise ConfigError(f"{key}: with fedavg_rounds its sites' own layers started from the FedAvg model of those rounds, "
                          f"which the federation's model does not carry: a newcomer cannot start where they did")
    curves: dict[str, list[float]] = {}
    models: dict[str, State] = {}
    for strategy in [s for s in STRATEGIES if s in strategies]:
        if strategy == "from_scratch":
            _, model, _ = start(seed + 7919)
        else:
            model = copy.deepcopy(base)
            model.load_state_dict(shared, strict=False)
        frozen = set(shared) if strategy == "freeze_global" else set()
        params = [p for n, p in model.named_parameters() if n not in frozen]
        # the shared BatchNorm statistics stay as downloaded under freeze_global (batches still use their own)
        norms = [m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and f"{n}.running_mean" in frozen]
        accs = []
        for r in range(1, rounds + 1):
            torch.manual_seed(int(make_generator(seed, r, client.index, 7).initial_seed()))  # whatever a model draws itself
            with contextlib.ExitStack() as stack:
                for m in norms:
                    stack.enter_context(running_stats_frozen(m))
                train_local(model, client, train, make_generator(seed, r, client.index), params=params)
            accs.append(evaluate(model, client.x_test, client.y_test, cfg=train)["acc"])
            if on_round is not None:
                on_round(strategy, r, accs[-1])
        curves[strategy] = accs
        models[strategy] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"pretrained_local_acc": None, "accuracy_per_round": curves, "final": {s: c[-1] for s, c in curves.items()}, "models": models}


def onboard_site(params: Params, experiment: str, root: Path, model_path: Path, strategies: Optional[Sequence[str]] = None,
                 out: Optional[Path] = None, quiet: bool = False) -> tuple[dict[str, Any], Path]:
    """A newcomer hospital adapts a deployed run's model on its own one-client ``experiment`` (its own params file
    under ``root``), on the device its own params name (``experiments.<e>.train.device``), scored on its test split
    after each round; it downloads the federation's model (``model_path``, the coordinator's final_model.pt) and
    sends nothing. pFedDB: its pre-existing local model first (``experiments.<e>.onboarding.pretrain_rounds`` rounds
    of pFedDB's Phase 1 on its data), then ``onboarding.rounds`` rounds of each of ``strategies`` from phi
    (:func:`~fedsilo.methods.pfeddb.onboarding.onboard_newcomer`). Another method: ``onboarding.rounds`` rounds of
    each strategy, from the federation's tensors on its plain backbone (:func:`adapt_federation_model`) or as its own
    sites train (``as_member``, :func:`adapt_as_member`). ``strategies`` None: the method's own way
    (:data:`DEFAULT_STRATEGY`; pFedDB's freeze_global).
    Writes ``model.pt`` (the first strategy's adapted model, in the form a deployed site keeps its model) and
    ``onboarding.json`` into ``out`` (default ``onboarding/<federation>/<method>/seed<k>`` under ``root``); returns
    the summary and the folder."""
    from fedsilo.fl.site import contract_mismatch, load_site, site_card
    from fedsilo.utils.io import canonical_hash
    from fedsilo.utils.progress import Progress

    root = Path(root)
    if experiment not in params.experiments:
        raise not_defined("experiments", experiment, params)
    kept = read_model_file(model_path)
    if not isinstance(kept, dict) or any(k not in kept for k in ("deployment", "server", "round")):
        raise ConfigError(f"--model: {model_path}: not a deployment's final model (the coordinator's final_model.pt, beside "
                          "its metrics.json)")
    dep = kept["deployment"]
    try:
        spec = deployment_spec(dep)
        key = str(dep["method"]["key"])
    except (KeyError, TypeError, ValueError) as err:  # a hand-edited or truncated deployment record
        raise ConfigError(f"--model: {model_path}: its deployment record is not one fedsilo wrote ({type(err).__name__}: {err})") from None
    pfeddb = issubclass(spec.method_cls, PFedDB)
    if spec.method_cls.stream_only:
        raise ConfigError(f"--model: {model_path}: the deployment trained {key}, a method of task streams; onboarding adapts a model "
                          "to one static client")
    card = site_card(params, experiment, root)  # the arrays hashed anew: a file changed after harmonize is refused
    if "tasks" in card:
        raise ConfigError(f"experiments.{experiment}.split: a stream of tasks; onboarding adapts to one static client")
    why = contract_mismatch(dep["contract"], card["contract"])
    if why:
        ds = params.experiments[experiment].dataset
        size = [int(v) for v in dep["contract"]["image_shape"]]
        fix = (f"; set datasets.{ds}.image_size: {size[0]} in {params.source} and harmonize again"
               if [int(v) for v in card["contract"]["image_shape"]][:2] != size[:2] else "")
        raise ConfigError(f"experiments.{experiment}: this site's data (datasets.{ds}) does not fit the deployment's contract: "
                          f"{'; '.join(why)}{fix}")
    members = [str(s["name"]) for s in dep["sites"]]
    if card["site"] in members:
        raise ConfigError(f"site {card['site']} took part in the deployment {dep['federation']}: it keeps its own model from "
                          "it (`fedsilo site audit` lists it); onboarding is for a hospital that did not")
    h, w, ch = (int(v) for v in dep["contract"]["image_shape"])
    from fedsilo.fl.flower import Card

    built, _, _ = spec.build(torch.zeros(2, ch, h, w), torch.device("cpu"), [Card(len(members), NEWCOMER, "", 0, (ch, h, w))])
    if strategies is None:  # the method's own way (DEFAULT_STRATEGY), pFedDB's Fig. 6 freeze_global
        strategies = ["freeze_global" if pfeddb else DEFAULT_STRATEGY[newcomer_rule(dep, built)]]
    unknown = [s for s in strategies if s not in ONBOARD_STRATEGIES]
    if unknown or not strategies or len(set(strategies)) != len(strategies):
        raise ConfigError(f"--strategy: {', '.join(strategies) or 'none'}: name each of {', '.join(ONBOARD_STRATEGIES)} at most once")
    if MEMBER in strategies:
        refusal = as_member_refusal(built, int(kept["round"]))
        if refusal is not None:
            raise ConfigError(f"--strategy {MEMBER}: {refusal}")
        if NEWCOMER not in kept:
            raise ConfigError(f"--strategy {MEMBER}: {model_path} holds no download for a newcomer (a final_model.pt "
                              "written by a fedsilo before this strategy): the coordinator runs the deployment again with a "
                              "current fedsilo, or the hospital adapts with another --strategy")
    exp = params.experiments[experiment]
    ob = exp.onboarding
    device = pick_device(exp.train.device, f"experiments.{experiment}.train.device")
    client = load_site(params, experiment, root, device, index=len(members))  # its own stream of seeded randomness
    assert not isinstance(client, list)
    n_cls = len(dep["contract"]["classes"])
    shared = {k: v.to(device) for k, v in (global_shared_branch(kept["server"]) if pfeddb else kept["server"]).items()}

    def backbone(init_seed: int):
        return build_model(spec.train.model, ch, n_cls, seed=init_seed, image_size=h, width=spec.train.model_width)

    with Progress(len(strategies) * ob.rounds, f"onboard {card['site']}", "round", quiet=quiet) as bar:
        def heard(s: str, r: int, acc: float) -> None:
            bar.update(1, f"{s} round {r}: test acc {acc:.3f}", line=r == ob.rounds)

        if pfeddb:
            res = onboard_newcomer(spec.method(), backbone, client, shared, ob.pretrain_rounds, ob.rounds, spec.seed,
                                   strategies, on_round=heard)
        else:
            plain = [x for x in strategies if x != MEMBER]
            res = adapt_federation_model(dep, client, shared, ob.rounds, plain, on_round=heard) if plain else {
                "pretrained_local_acc": None, "accuracy_per_round": {}, "final": {}, "models": {}}
            if MEMBER in strategies:
                member = adapt_as_member(spec, client, kept[NEWCOMER], ob.rounds, on_round=heard)
                for part in ("accuracy_per_round", "final", "models"):
                    res[part].update(member[part])
    models = res.pop("models")
    keep = strategies[0]
    # what it read of final_model.pt: the federation's model, and for as_member the downloads a newcomer is sent
    read = {**(shared if [x for x in strategies if x != MEMBER] else {}),
            **({**kept[NEWCOMER]["download"], **kept[NEWCOMER]["eval"]} if MEMBER in strategies else {})}
    summary = {
        "site": card["site"],
        "fingerprint": card["fingerprint"],
        "federation": dep["federation"],
        "method": key,
        "seed": spec.seed,
        "deployment_sha256": canonical_hash(dep),
        "from_model": str(model_path),
        "server_round": int(kept["round"]),
        "strategies": [s for s in ONBOARD_STRATEGIES if s in strategies],
        "kept": keep,
        "pretrain_rounds": ob.pretrain_rounds if pfeddb else 0,  # a pFedDB newcomer's own local model first
        "rounds": ob.rounds,
        "bytes_down": payload_bytes(read),  # what it downloaded: the federation's model (pFedDB: phi), or a newcomer's downloads, once
        **res,
    }
    out = Path(out) if out is not None else root / "onboarding" / str(dep["federation"]) / key / f"seed{spec.seed}"
    if (out / "onboarding.json").is_file():  # a second onboarding (another --strategy) replaces the first: said
        before = read_json(out / "onboarding.json")
        summary["replaced"] = {"kept": before.get("kept"), "strategies": before.get("strategies")}
    with atomic_dir(out) as tmp:
        torch.save({"site": card["site"], "fingerprint": card["fingerprint"], "round": ob.rounds, "deployment": dep, "onboarding": {k: summary[k] for k in (
            "strategies", "kept", "pretrain_rounds", "rounds", "server_round", "from_model")}, "model": models[keep]}, tmp / "model.pt")
        os.chmod(tmp / "model.pt", 0o600)  # trained on the site's images: as a deployed site keeps its model
        write_json(tmp / "onboarding.json", summary)
    return summary, out
