"""A site of a real deployment: its own images, harmonized and split by fedsilo's own stages on its own machine, and
the card it registers with.

A hospital never pools its images. It runs ``fedsilo fetch`` / ``harmonize`` / ``split`` (or ``dvc repro``) with a
params file of its own whose dataset lists only its own source(s) and whose experiment splits them into one client
(``domain_clients`` over its one domain: train, optional validation, test), or, for a federation that learns a
stream of domain tasks, into one client's stream (``domain_incremental`` with ``clients: 1`` and the hospital's name
in ``names``: its images of each domain, a task each, in the agreed order). :func:`site_card` then describes that
client for the federation, from hashes and counts only:

- ``contract``: what every site of a federation must share for one model to serve them all: the task, the class
  names in label order, and the harmonized image shape (height, width, channels).
- ``fingerprint``: sha256 over the contract, the sha256 of the harmonized arrays (recomputed from the files, not read
  from the card harmonize wrote) and the sha256 of the split file. The coordinator pins each site's fingerprint in the
  federation file; a site that starts with any other data (re-harmonized with other options, another split seed, a
  different source) is refused at registration, and a run's results record the fingerprints it was trained on.

Nothing here reads or sends an image: the card holds names, counts and hashes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import torch

from fedsilo.client.data import ClientData, load_clients, load_task_clients
from fedsilo.config import ConfigError, Params
from fedsilo.config.errors import not_defined
from fedsilo.data.cards import ARRAYS, refuse_changed_arrays
from fedsilo.data.splits import refuse_stale_split
from fedsilo.utils.io import canonical_hash, file_sha256, read_json

__all__ = ["contract_mismatch", "load_site", "site_card"]


def _site_files(params: Params, experiment: str, root: Path) -> tuple[Path, Path, dict[str, Any], dict[str, Any]]:
    if experiment not in params.experiments:
        raise not_defined("experiments", experiment, params)
    exp = params.experiments[experiment]
    layout = params.layout(root)
    harmonized, split_path = layout.harmonized(exp.dataset), layout.split(experiment)
    for p in [harmonized / a for a in ARRAYS] + [harmonized / "card.json", split_path]:
        if not p.exists():
            raise FileNotFoundError(f"{p}: missing; run the site's harmonize and split stages first "
                                    f"(`fedsilo harmonize --dataset {exp.dataset}`, `fedsilo split --experiment {experiment}`)")
    split, card = read_json(split_path), read_json(harmonized / "card.json")
    from fedsilo.data.harmonize import refuse_stale_rules  # here: every source reader, not at each ClientApp start

    refuse_stale_rules(card, params.datasets[exp.dataset], harmonized, exp.dataset,  # its settings edited, not harmonized
                       f"`fedsilo harmonize --dataset {exp.dataset}` and `fedsilo split --experiment {experiment}`")
    if exp.split.protocol not in ("domain_clients", "domain_incremental") or len(split["clients"]) != 1:
        raise ConfigError(
            f"experiments.{experiment}.split: a site's split holds its own data as one client (protocol domain_clients "
            f"over the site's one domain, or domain_incremental with clients: 1 for a stream of tasks); this one has "
            f"protocol {exp.split.protocol} and {len(split['clients'])} clients "
            f"({', '.join(c['name'] for c in split['clients'])})")
    if split.get("data_sha256") != card["sha256"]:
        raise ConfigError(f"{split_path}: built for other arrays than {harmonized} holds (re-harmonized since); rerun "
                          f"`fedsilo split --experiment {experiment}`")
    refuse_stale_split(split, exp.split, split_path, experiment, f"`fedsilo split --experiment {experiment}`")
    return harmonized, split_path, split, card


def site_card(params: Params, experiment: str, root: Path = Path(".")) -> dict[str, Any]:
    """The card of the site whose params are ``params``: its client's name and domain, its image counts, the
    contract and the fingerprint (see the module). Hashes the harmonized arrays anew: a file changed after harmonize
    is refused here, not trained on."""
    harmonized, split_path, split, card = _site_files(params, experiment, Path(root))
    refuse_changed_arrays(harmonized, card, "re-run `fedsilo harmonize` and `fedsilo split`")
    contract, data, split_sha, fingerprint = _fingerprint(card, split_path)  # the arrays as just hashed anew
    client = split["clients"][0]
    tasks = client.get("tasks")  # a stream: the site's images of each domain, in task order
    counts = {"n_train": sum(len(t["train"]) for t in tasks), "n_val": 0, "n_test": sum(len(t["test"]) for t in tasks),
              "tasks": [{"domain": str(t["domain"]), "n_train": len(t["train"]), "n_test": len(t["test"])} for t in tasks]} \
        if tasks is not None else {"n_train": len(client["train"]), "n_val": len(client.get("val") or []), "n_test": len(client["test"])}
    return {
        "site": str(client["name"]),
        "domain": str(client.get("domain", tasks[0]["domain"] if tasks else client["name"])),
        "dataset": str(split.get("dataset", params.experiments[experiment].dataset)),
        "experiment": experiment,
        **counts,
        "contract": contract,
        "data_sha256": data,
        "split_sha256": split_sha,
        "fingerprint": fingerprint,
    }


def _fingerprint(card: dict[str, Any], split_path: Path) -> tuple[dict[str, Any], dict[str, str], str, str]:
    """(contract, array hashes, split hash, fingerprint) of a site's harmonized card and split file."""
    data = {a: card["sha256"][a] for a in ARRAYS}
    contract = {"task": card["task"], "classes": list(card["classes"]), "image_shape": [int(s) for s in card["image_shape"]]}
    split_sha = file_sha256(split_path)
    return contract, data, split_sha, canonical_hash({"contract": contract, "data": data, "split": split_sha})


def recorded_fingerprint(card: dict[str, Any], split_path: Path) -> str:
    """The fingerprint a site with this harmonized card and split file has, from the card's recorded array hashes
    (the arrays not hashed anew: for a caller that has just checked them, ``fedsilo site evaluate``), whatever the
    params say of the split now: a split edited in params and not rebuilt is still the one trained on."""
    return _fingerprint(card, split_path)[3]


def contract_mismatch(agreed: dict[str, Any], site: dict[str, Any]) -> list[str]:
    """What differs between a federation's contract and a site's, in words (empty when they agree)."""
    def norm(v: Any) -> Any:
        return [norm(x) for x in v] if isinstance(v, (list, tuple)) else v

    return [f"{k} {site.get(k)} (agreed {agreed.get(k)})" for k in ("task", "classes", "image_shape")
            if norm(agreed.get(k)) != norm(site.get(k))]


def load_site(params: Params, experiment: str, root: Path, device: torch.device, index: int = -1) -> Union[ClientData, list[ClientData]]:
    """The site's one client (train, validation where its split has one, test) as ``ClientData``, or for a stream
    split its client of each task in task order; ``index`` is the one the federation gave it (the coordinator's order
    of sites)."""
    harmonized, _, split, _ = _site_files(params, experiment, Path(root))
    if split.get("protocol") == "domain_incremental":
        tasks, _, _, _ = load_task_clients(harmonized, split, device)
        stream = [row[0] for row in tasks]
        for c in stream:
            c.index = int(index)
        return stream
    (client,), _, _ = load_clients(harmonized, split, device)
    client.index = int(index)
    return client
