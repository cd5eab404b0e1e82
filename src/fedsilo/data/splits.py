"""The split stage: harmonized dataset -> clients with train/test indices (rows of ``records.parquet``).

``domain_clients`` (pFedDB, FedBN): one client per domain; ``n_train`` training images and ``n_test`` test images
(default: as many as ``n_train``; ``n_test_per_domain`` overrides, e.g. OpenI 116), patient-disjoint: patients are
shuffled with the seed and assigned whole, first to train, then to test. A patient that would overflow a side
contributes only the images still needed and its other images are left unused, never placed on the other side.
The split is a pure function of (records, params, seed).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pandas as pd

from fedsilo.config import DomainClientsSplit


class SplitError(ValueError):
    pass


def _domain_rng(seed: int, domain: str) -> np.random.Generator:
    return np.random.default_rng([seed, int(hashlib.sha256(domain.encode()).hexdigest()[:8], 16)])


def _take(groups: list[np.ndarray], need: int) -> tuple[list[int], int]:
    """Take whole groups until ``need`` rows are reached; returns (rows, groups consumed)."""
    rows: list[int] = []
    used = 0
    for g in groups:
        if len(rows) >= need:
            break
        rows.extend(g[: need - len(rows)].tolist())
        used += 1
    return rows, used


def domain_clients(records: pd.DataFrame, params: DomainClientsSplit, seed: int) -> dict[str, Any]:
    domains = list(params.domains) if params.domains else list(dict.fromkeys(records["domain"]))
    clients = []
    for dom in domains:
        sub = records[records["domain"] == dom]
        if sub.empty:
            raise SplitError(f"split.domains: domain {dom!r} has no images (have: {sorted(records['domain'].unique())})")
        n_train = params.n_train
        n_test = params.n_test_per_domain.get(dom, params.n_test or params.n_train)
        rng = _domain_rng(seed, dom)
        names = sorted(sub["group"].unique())
        order = rng.permutation(len(names))
        by_group = {g: np.sort(idx.to_numpy()) for g, idx in sub.groupby("group").groups.items()}
        groups = [rng.permutation(by_group[names[i]]) for i in order]
        train, used = _take(groups, n_train)
        test, _ = _take(groups[used:], n_test)
        if len(train) < n_train or len(test) < n_test:
            raise SplitError(
                f"domain {dom!r}: {len(sub)} images from {len(names)} patients cannot give {n_train} train + "
                f"{n_test} test patient-disjoint images (lower split.n_train / n_test or add data)"
            )
        clients.append(
            {
                "client": len(clients),
                "name": dom,
                "domain": dom,
                "train": sorted(int(i) for i in train),
                "test": sorted(int(i) for i in test),
            }
        )
    return {
        "protocol": "domain_clients",
        "seed": seed,
        "params": params.model_dump(mode="json"),
        "num_classes": int(records["label"].max()) + 1,
        "clients": clients,
    }


def make_split(records: pd.DataFrame, params: DomainClientsSplit, seed: int) -> dict[str, Any]:
    if params.protocol == "domain_clients":
        return domain_clients(records, params, seed)
    raise SplitError(f"split.protocol: {params.protocol!r} is not implemented")  # pragma: no cover


def check_patient_disjoint(records: pd.DataFrame, split: dict[str, Any]) -> None:
    for c in split["clients"]:
        tr = set(records.loc[c["train"], "group"])
        te = set(records.loc[c["test"], "group"])
        both = tr & te
        if both:
            raise SplitError(f"client {c['name']}: patient(s) {sorted(both)[:3]} in both train and test")
