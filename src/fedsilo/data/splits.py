"""The split stage: harmonized dataset -> clients (and tasks) with train/test indices (rows of ``records.parquet``).

Every protocol is a pure function of (records, params, seed): the same inputs give the same JSON, byte for byte.
Rows are always assigned as whole groups (patients for chest X-rays, single images for the benchmarks), so one
patient never lands on both sides of a client's train/test split. Where a domain has an official test subset
(``records.subset == "test"``), ``test_from: auto`` draws test images from it and training images from the rest;
``pooled`` ignores the subset.

- ``domain_clients`` (pFedDB, FedBN): one client per domain with ``n_train`` / ``n_test`` images.
- ``domain_multi_clients`` (F2DC): ``clients_per_domain[d]`` clients on domain d, each holding a disjoint
  ``fraction`` of the domain's training pool (disjoint but for the images ``every_class`` swaps in, as the F²DC
  code's partition); the clients of a domain share its test set.
- ``label_skew`` (FedeCouple, CD2-pFed): Dirichlet(beta) (per class over the clients, or with ``samples_per_client``
  FedLab's balanced form: every client that many images with its own Dir(beta) class shares), pathological (k classes per client), shards (LG-FedAvg's:
  at most k) or weak pathological (s % uniform over the classes, the rest from ``classes_per_client`` dominant
  classes), over the pooled domains (``test_from: official``: the training subset, each client's test side from the
  official test subset with its classes);
  each client's images are then split into train and test with the same class mix (weak pathological and the
  balanced Dirichlet: the two sides are two draws of the mixture, as FedPAC's code draws each client's 600 training
  and 300 test images).
- ``domain_incremental`` (pFedDIL): the same sequence of domain tasks for every client; each domain's images are
  spread over the clients with Dirichlet(alpha) label skew, train and test with the same proportions.
- ``holdout_domain``: ``domain_clients`` without one domain, which becomes a late-joining client (``newcomer``) or
  an ``external_test`` set, stored under ``holdout``.
- ``by_writer`` (FEMNIST, FedeCouple's Table V): the natural partition, one client per writer (``records.writer``),
  ``clients`` writers drawn; each writer's own train / test subsets where the data has them, else LEAF's per-writer
  sample split.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import PurePosixPath
from typing import Any, Callable, Optional

import numpy as np
import pandas as pd

from fedsilo.config import (
    ByWriterSplit,
    DomainClientsSplit,
    DomainIncrementalSplit,
    DomainMultiClientsSplit,
    HoldoutDomainSplit,
    LabelSkewSplit,
    did_you_mean,
)

log = logging.getLogger(__name__)


class SplitError(ValueError):
    pass


def _rng(seed: int, *keys: str) -> np.random.Generator:
    return np.random.default_rng([seed] + [int(hashlib.sha256(k.encode()).hexdigest()[:8], 16) for k in keys])



def _take(groups: list[np.ndarray], need: int) -> tuple[list[int], int]:
    """Take whole groups until ``need`` rows are reached; returns (rows, groups consumed). A group that would
    overflow contributes only the rows still needed; its other rows stay unused."""
    rows: list[int] = []
    used = 0
    for g in groups:
        if len(rows) >= need:
            break
        rows.extend(g[: need - len(rows)].tolist())
        used += 1
    return rows, used


def _shuffled_groups(sub: pd.DataFrame, rng: np.random.Generator) -> list[np.ndarray]:
    by_group = {g: np.sort(idx.to_numpy()) for g, idx in sub.groupby("group").groups.items()}
    names = sorted(by_group)
    return [rng.permutation(by_group[names[i]]) for i in rng.permutation(len(names))]


def _uses_official(sub: pd.DataFrame, test_from: str, dom: str, other: str = "use 'auto' or 'pooled'") -> bool:
    has = bool((sub["subset"] == "test").any()) if "subset" in sub else False
    if test_from == "official" and not has:
        raise SplitError(f"split.test_from: domain {dom!r} has no official test subset ({other})")
    return test_from == "official" or (test_from == "auto" and has)


def _domains(records: pd.DataFrame, wanted: tuple[str, ...] | None, key: str = "domains") -> list[str]:
    """``wanted`` (the split's ``key``: ``domains``, ``domain_order``, ``clients_per_domain``, ``holdout``), each
    checked to be a domain of the data: a SplitError naming the key and the first that is not."""
    have = list(dict.fromkeys(records["domain"]))
    if not wanted:
        return have
    for d in wanted:
        if d not in have:
            raise SplitError(f"split.{key}: domain {d!r} has no images{did_you_mean(d, have)} (have: {sorted(have)})")
    return list(wanted)


def _client(index: int, name: str, domain: str, train: list[int], test: list[int], val: list[int] | None = None) -> dict[str, Any]:
    out = {"client": index, "name": name, "domain": domain, "train": sorted(int(i) for i in train), "test": sorted(int(i) for i in test)}
    if val:  # only where a validation set was asked for: splits without one stay byte for byte as before
        out["val"] = sorted(int(i) for i in val)
    return out


def _num_classes(records: pd.DataFrame) -> int:
    return int(records["label"].max()) + 1


# --------------------------------------------------------------------------- domain_clients
def _draw_domain(records: pd.DataFrame, dom: str, n_train: int, n_test: int, test_from: str, seed: int,
                 n_val: int = 0) -> tuple[list[int], list[int], list[int]]:
    """(train, test, val) rows of one domain, patient-disjoint; val comes from the training pool after train (the
    draws of train and test do not depend on n_val, so adding a validation set leaves them as they were)."""
    sub = records[records["domain"] == dom]
    if sub.empty:
        _domains(records, (dom,))  # raises, naming it
    rng = _rng(seed, dom)
    if _uses_official(sub, test_from, dom):
        pool = _shuffled_groups(sub[sub["subset"] != "test"], rng)
        train, used = _take(pool, n_train)
        test, _ = _take(_shuffled_groups(sub[sub["subset"] == "test"], rng), n_test)
        val, _ = _take(pool[used:], n_val)
    else:
        groups = _shuffled_groups(sub, rng)
        train, used = _take(groups, n_train)
        test, used_test = _take(groups[used:], n_test)
        val, _ = _take(groups[used + used_test:], n_val)
    if len(train) < n_train or len(test) < n_test or len(val) < n_val:
        val_part = f" + {n_val} validation" if n_val else ""
        if len(train) < n_train and _uses_official(sub, test_from, dom):  # the pool the official test subset leaves
            rest = sub[sub["subset"] != "test"]
            raise SplitError(
                f"domain {dom!r}: the official test subset holds {int((sub['subset'] == 'test').sum())} of its {len(sub)} images "
                f"and leaves {len(rest)} ({rest['group'].nunique()} groups) to train on: not {n_train} train{val_part} "
                f"(split.test_from: {test_from} takes the test images from that subset; a copy holding the test subset "
                f"only, such as MNIST's test set alone, needs test_from: pooled, or the training files beside it)")
        if len(test) < n_test and _uses_official(sub, test_from, dom):  # the official test subset itself is short
            official = sub[sub["subset"] == "test"]
            raise SplitError(
                f"domain {dom!r}: its official test subset holds {len(official)} images ({official['group'].nunique()} "
                f"groups), not the {n_test} of split.n_test (split.test_from: {test_from} takes them from that subset: "
                "lower n_test, take them all with n_test: all, or draw them from the pooled images with test_from: pooled)")
        raise SplitError(
            f"domain {dom!r}: {len(sub)} images from {sub['group'].nunique()} patients cannot give {n_train} train{val_part} + "
            f"{n_test} test patient-disjoint images (lower split.n_train{' / n_val' if n_val else ''} / n_test or add data)"
        )
    return train, test, val


def _fedbn_sizes(records: pd.DataFrame, params: DomainClientsSplit, doms: list[str]) -> dict[str, tuple[int, int, int]]:
    """FedBN's Office / DomainNet sizes (its loaders; pFedDB's code keeps them): m = the smallest domain's training
    pool (the official training subset, or what test_fraction leaves), then floor(f_train x m) training and
    floor(f_val x m) validation images for every client, and the whole official test subset (or test_fraction of the
    domain) as its test set. Returns domain -> (n_train, n_test, n_val)."""
    pools, tests = {}, {}
    for dom in doms:
        sub = records[records["domain"] == dom]
        if _uses_official(sub, params.test_from, dom):
            tests[dom] = int((sub["subset"] == "test").sum())
        elif params.test_fraction is None:
            raise SplitError(f"split.test_fraction: domain {dom!r} has no official test subset (FedBN's <site>_test.pkl "
                             "lists); give the share of each domain held out as its test set")
        else:
            tests[dom] = max(1, int(round(params.test_fraction * len(sub))))
        pools[dom] = len(sub) - tests[dom]
    m = min(pools.values())
    n_train, n_val = int(np.floor(params.n_train_of_smallest * m)), int(np.floor((params.n_val_of_smallest or 0.0) * m))
    if n_train < 1:
        raise SplitError(f"split.n_train_of_smallest: {params.n_train_of_smallest} x {m} (the smallest training pool) is less than one image")
    return {dom: (n_train, tests[dom], n_val) for dom in doms}


def domain_clients(records: pd.DataFrame, params: DomainClientsSplit | HoldoutDomainSplit, seed: int, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    clients = []
    n_val = getattr(params, "n_val", 0)  # holdout_domain's clients have no validation set
    doms = [d for d in _domains(records, params.domains) if d not in exclude]
    fedbn = _fedbn_sizes(records, params, doms) if getattr(params, "n_train_of_smallest", None) else {}
    for dom in doms:
        n_test = params.n_test_per_domain.get(dom, params.n_test or params.n_train)
        if n_test == "all":  # the domain's whole official test subset
            sub = records[records["domain"] == dom]
            if not _uses_official(sub, params.test_from, dom):
                raise SplitError(f"split.n_test: 'all' takes domain {dom!r}'s whole official test subset, and it has none "
                                 f"(test_from: {params.test_from}); give a number")
            n_test = int((sub["subset"] == "test").sum())
        n_train, n_test, n_val = fedbn.get(dom, (params.n_train, n_test, n_val))
        train, test, val = _draw_domain(records, dom, n_train, n_test, params.test_from, seed, n_val)
        clients.append(_client(len(clients), dom, dom, train, test, val))
    dump = params.model_dump(mode="json")
    if not dump.get("n_val"):  # a split with no validation set is written as before n_val existed (same bytes, same hash)
        dump.pop("n_val", None)
    for key in ("n_train_of_smallest", "n_val_of_smallest", "test_fraction"):  # likewise for FedBN's sizes
        if key in dump and dump[key] is None:
            dump.pop(key)
    return {"protocol": params.protocol, "seed": seed, "params": dump, "num_classes": _num_classes(records), "clients": clients}


# --------------------------------------------------------------------------- domain_multi_clients
def domain_multi_clients(records: pd.DataFrame, params: DomainMultiClientsSplit, seed: int) -> dict[str, Any]:
    clients = []
    for dom, k in params.clients_per_domain.items():
        sub = records[records["domain"] == dom]
        if sub.empty:
            _domains(records, (dom,), "clients_per_domain")  # raises, naming it
        if k < 1:
            raise SplitError(f"split.clients_per_domain.{dom}: need at least one client")
        if k * params.fraction > 1.0 + 1e-9:
            raise SplitError(f"split: {k} clients x fraction {params.fraction} > 1 for domain {dom!r}; clients' data must be disjoint")
        rng = _rng(seed, dom)
        if _uses_official(sub, params.test_from, dom):
            train_groups = _shuffled_groups(sub[sub["subset"] != "test"], rng)
            test_groups = _shuffled_groups(sub[sub["subset"] == "test"], rng)
        elif params.test_select == "listing":
            train_groups, test_groups = _by_listing(sub, params.test_fraction, rng, dom)
        else:
            groups = _shuffled_groups(sub, rng)
            n_test_groups = max(1, int(round(params.test_fraction * len(groups))))
            test_groups, train_groups = groups[:n_test_groups], groups[n_test_groups:]
        pool = sum(len(g) for g in train_groups)
        per_client = int(np.floor(params.fraction * pool))
        if per_client < 1:
            raise SplitError(f"domain {dom!r}: fraction {params.fraction} of {pool} training images is less than one image")
        n_test = params.n_test or sum(len(g) for g in test_groups)
        test, _ = _take(test_groups, n_test)
        if len(test) < n_test:
            raise SplitError(f"domain {dom!r}: test pool has {len(test)} images, split.n_test asks {n_test}")
        pool_rows = np.concatenate(train_groups)
        if params.every_class and sub.groupby("group").size().max() > 1:
            raise SplitError(f"split.every_class: swaps images one by one; domain {dom!r} groups several images (patients)")
        for j in range(k):
            train, used = _take(train_groups, per_client)
            train_groups = train_groups[used:]
            if params.every_class:
                train, train_groups = _every_class(train, train_groups, pool_rows, records["label"], rng, f"{dom}-{j}")
            clients.append(_client(len(clients), f"{dom}-{j}", dom, train, test))
    dump = params.model_dump(mode="json")
    if dump.get("test_select") == "seeded":  # a split without the F²DC code's rules is written as before they existed
        dump.pop("test_select")
    if not dump.get("every_class"):
        dump.pop("every_class", None)
    return {"protocol": params.protocol, "seed": seed, "params": dump, "num_classes": _num_classes(records), "clients": clients}


def _by_listing(sub: pd.DataFrame, test_fraction: float, rng: np.random.Generator, dom: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The F²DC code's train / test rule (its ``ImageFolder_Custom``): the domain's images in the order torchvision's
    ImageFolder lists them, which is the order of their paths under the domain (class folder, then file name), position
    i a test image when i mod 10 >= 10 (1 - test_fraction) (with 0.2: positions 8 and 9 of every ten, so each class's
    test share is a fifth give or take one image). Benchmark images only: each its own group, each with its path.
    Returns (train groups shuffled, test groups in listing order), one image per group."""
    if "source_path" not in sub or (sub["source_path"].fillna("") == "").any():
        raise SplitError(f"split.test_select: listing orders a domain's images by their file paths; domain {dom!r} has "
                         "images without one (records.source_path)")
    if sub.groupby("group").size().max() > 1:
        raise SplitError(f"split.test_select: listing assigns images one by one; domain {dom!r} groups several images "
                         "(patients), which must stay on one side")
    # ImageFolder sorts class folders by name, then each folder's files: the paths' parts compared in turn (a whole-path
    # string sort would put "dog x/1.jpg" before "dog/1.jpg", ImageFolder "dog" first)
    order = sub.index.to_numpy()[sorted(range(len(sub)), key=lambda i: PurePosixPath(sub["source_path"].iat[i]).parts)]
    keep = 10 - int(round(10 * test_fraction))
    test = np.arange(len(order)) % 10 >= keep
    return [np.array([r]) for r in rng.permutation(order[~test])], [np.array([r]) for r in order[test]]


def _every_class(train: list[int], rest: list[np.ndarray], pool: np.ndarray, labels: pd.Series, rng: np.random.Generator,
                 name: str) -> tuple[list[int], list[np.ndarray]]:
    """The F²DC code's class completion of one client's draw (``partition_office_domain_skew_loaders_new``): for each
    class of the domain's training pool the draw missed (in class order), one of that class's images, drawn from the
    whole pool, is added, and one image of a class drawn among those the client holds twice or more is taken out. An
    added image leaves the pool the later clients draw from; a removed one goes back to it (shuffled in), as the
    code's pool is what no client selected. The added image may be one an earlier client of the domain holds (the
    code does not check it either)."""
    have = labels.to_numpy()
    rows = list(train)
    classes = np.unique(have[pool])
    back: list[int] = []
    for c in classes:
        if (have[rows] == c).any():
            continue
        counts = {k: int((have[rows] == k).sum()) for k in np.unique(have[rows])}
        spare = sorted(k for k, n in counts.items() if n >= 2)
        if not spare:
            raise SplitError(f"split.every_class: client {name} holds {len(rows)} images, too few to hold each of the "
                             f"{len(classes)} classes of its domain")
        add = int(rng.choice(pool[have[pool] == c]))
        drop_class = spare[int(rng.integers(len(spare)))]
        candidates = [r for r in rows if have[r] == drop_class]
        drop = candidates[int(rng.integers(len(candidates)))]
        rows = [r for r in rows if r != drop] + [add]
        back.append(drop)
    if not back:
        return rows, rest
    taken = set(rows)
    remaining = [int(r) for g in rest for r in g if int(r) not in taken] + [r for r in back if r not in taken]
    return rows, [np.array([r]) for r in rng.permutation(np.array(remaining, dtype=np.int64))]


# --------------------------------------------------------------------------- label skew
def _cut(idx: np.ndarray, shares: np.ndarray) -> list[np.ndarray]:
    """``idx`` cut into consecutive pieces proportional to ``shares`` (which sum to 1)."""
    return np.split(idx, (np.cumsum(shares) * len(idx)).astype(int)[:-1])


def _dirichlet_parts(labels: np.ndarray, n_clients: int, beta: float, min_size: int, rng: np.random.Generator, what: str,
                     balance: bool = False) -> list[np.ndarray]:
    """Per class, proportions ~ Dir(beta); class rows cut accordingly. Redrawn until every client has min_size.
    ``balance``: NIID-Bench's rule (also PFLlib's "practical" split): a client that already holds its equal share
    (len(labels) / n_clients) gets no part of the classes drawn after, which lets very small beta reach min_size."""
    classes = np.unique(labels)
    cap = len(labels) / n_clients
    for _ in range(1000):
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(n_clients, beta))
            if balance:  # some client is always below its share while images remain to be dealt
                shares = shares * np.array([len(p) < cap for p in parts])
                if shares.sum() == 0:  # small beta draws exact zeros: every client below its share drew none
                    break  # of this class, so the draw cannot place it; redraw
                shares = shares / shares.sum()
            for j, chunk in enumerate(_cut(idx, shares)):
                parts[j].extend(chunk.tolist())
        else:
            if min(len(p) for p in parts) >= min_size:
                return [np.array(sorted(p), dtype=np.int64) for p in parts]
    raise SplitError(f"{what}: no Dirichlet draw in 1000 gave every one of {n_clients} clients {min_size} images (raise beta or lower min_per_client)")


def _deal(labels: np.ndarray, holders_of: dict[int, list[int]], n_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each class's rows, shuffled, cut into as many near-equal pieces as the class has holder slots; piece i goes to
    the client of slot i (a client holding two slots of a class takes two pieces)."""
    parts: list[list[int]] = [[] for _ in range(n_clients)]
    for c in np.unique(labels):
        holders = holders_of.get(int(c), [])
        if not holders:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        for j, chunk in zip(holders, np.array_split(idx, len(holders))):
            parts[j].extend(chunk.tolist())
    return [np.array(sorted(p), dtype=np.int64) for p in parts]


def _deal_sides(labels: np.ndarray, test_labels: Optional[np.ndarray], holders_of: dict[int, list[int]], n_clients: int,
                rng: np.random.Generator) -> tuple[list[np.ndarray], Optional[list[np.ndarray]]]:
    """:func:`_deal` of the training labels and, given the official test subset's, of those to the same holders."""
    parts = _deal(labels, holders_of, n_clients, rng)
    return parts, (None if test_labels is None else _deal(test_labels, holders_of, n_clients, rng))


def _pathological(labels: np.ndarray, n_clients: int, k: int, rng: np.random.Generator,
                  test_labels: Optional[np.ndarray] = None) -> tuple[list[np.ndarray], Optional[list[np.ndarray]]]:
    """Each client k distinct classes; a class's images shared evenly by the clients holding it. Given the official
    test subset's labels, its images are dealt to the same holders (each client's test side from the official test)."""
    classes = np.unique(labels)
    if k > len(classes):
        raise SplitError(f"split.classes_per_client: {k} > the {len(classes)} classes present")
    for _ in range(1000):
        slots = np.concatenate([rng.permutation(classes) for _ in range(int(np.ceil(n_clients * k / len(classes))) + 1)])[: n_clients * k]
        owned = slots.reshape(n_clients, k)
        if all(len(set(row)) == k for row in owned):
            break
    else:  # pragma: no cover - practically unreachable for k <= classes
        raise SplitError("split: cannot give every client distinct classes")
    holders_of = {int(c): [j for j in range(n_clients) if c in owned[j]] for c in classes}
    return _deal_sides(labels, test_labels, holders_of, n_clients, rng)


def _shards(labels: np.ndarray, n_clients: int, s: int, rng: np.random.Generator,
            test_labels: Optional[np.ndarray] = None) -> tuple[list[np.ndarray], Optional[list[np.ndarray]]]:
    """FedAvg's and LG-FedAvg's label shards (CD2-pFed's "at most s classes" follows LG-FedAvg): every class is cut
    into m = K s / C shards, the K s shard slots (each class m times) are shuffled and dealt s to a client, and each
    slot takes one shard of its class. A client that draws a class twice holds two of its shards, so it holds at most
    s classes; every image is dealt. Given the official test subset's labels, it is cut the same way and each slot
    takes a test shard too (LG-FedAvg's code reuses the slots on the test set)."""
    classes = np.unique(labels)
    per_class, left = divmod(n_clients * s, len(classes))
    if left or not per_class:
        raise SplitError(f"split.classes_per_client: shards need clients x classes_per_client ({n_clients} x {s}) to be a "
                         f"multiple of the {len(classes)} classes (each class is cut into the same number of shards)")
    slots = rng.permutation(np.repeat(classes, per_class)).reshape(n_clients, s)
    holders_of = {int(c): [j for j in range(n_clients) for slot in slots[j] if slot == c] for c in classes}
    return _deal_sides(labels, test_labels, holders_of, n_clients, rng)


def _spread(total: int, classes: np.ndarray, rng: np.random.Generator) -> dict[int, int]:
    """``total`` images over ``classes`` as evenly as whole numbers allow: each class takes ``total // len`` and the
    remainder goes one each to classes drawn at random (no draw when it divides: 120 over 10 classes is 12 each)."""
    base, extra = divmod(total, len(classes))
    counts = {int(c): base for c in classes}
    if extra:
        for c in rng.choice(classes, size=extra, replace=False):
            counts[int(c)] += 1
    return counts


def _class_pools(pools: list[np.ndarray], classes: np.ndarray, rng: np.random.Generator) -> list[dict[int, list[int]]]:
    """Each pool's rows of every class, shuffled: the images a per-client draw takes from (one pool, or the training
    and the official test subset)."""
    return [{int(c): list(rng.permutation(np.flatnonzero(lab == c))) for c in classes} for lab in pools]


def _take_sides(pop: Callable[[int, int, int], list[int]], classes: np.ndarray, train: dict[int, int], test: dict[int, int],
                official: bool) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """One client's rows by per-class counts, ``pop(pool, class, count)`` taking them: from one pool both sides'
    images (its test count per class split off afterwards), or the training rows from the first pool and the test
    rows from the official test subset's."""
    if not official:
        rows = [i for c in classes for i in pop(0, int(c), train[int(c)] + test[int(c)])]
        return np.array(sorted(rows), dtype=np.int64), None
    rows = [i for c in classes for i in pop(0, int(c), train[int(c)])]
    return (np.array(sorted(rows), dtype=np.int64),
            np.array(sorted(i for c in classes for i in pop(1, int(c), test[int(c)])), dtype=np.int64))


def _weak_pathological(labels: np.ndarray, n_clients: int, s: float, n: int, frac: float, dominant: int,
                       rng: np.random.Generator, groups: Optional[tuple[tuple[int, ...], ...]] = None,
                       test_labels: Optional[np.ndarray] = None,
                       ) -> tuple[list[np.ndarray], list[dict[int, int]], Optional[list[np.ndarray]]]:
    """Each client's ``n`` images as two draws of the one mixture, its training side and its test side (FedPAC's code
    draws 600 training and 300 test images per client, each ``s`` % spread evenly over all classes and the rest over the
    dominant classes). Returns each client's rows, per class how many of them are its test images (one split of the
    client's rows by a per-class fraction would round every class on its own: CIFAR-100 at s = 20, 2 uniform images a
    class, one to each side, left 17.5 % uniform in training and 30 % in test) and, given the official test subset's
    labels, the test rows drawn from it (FedPAC's code: the 300 from the official test set); then the first list holds
    the training rows alone. Where the training side's spread part is smaller than the class count (a quickstart's 6
    images over 10 classes), the test side's spread part goes to the classes the training side's drew, so no client
    is tested on a class it holds no training image of."""
    classes = np.unique(labels)
    if groups is not None:
        unknown = sorted({int(c) for g in groups for c in g} - {int(c) for c in classes})
        if unknown or not all(groups):
            raise SplitError(f"split.dominant_groups: classes {unknown} have no image in the pool" if unknown else "split.dominant_groups: an empty group")
    pools = [labels] if test_labels is None else [labels, test_labels]
    free = _class_pools(pools, classes, rng)

    def pop(side: int, c: int, m: int, j: int) -> list[int]:
        if len(free[side][c]) < m:
            where = " of the official test subset" if side else ""
            raise SplitError(f"split (weak pathological): class {c}{where} runs out of images at client {j}; lower samples_per_client or s")
        out, free[side][c] = free[side][c][:m], free[side][c][m:]
        return out

    n_test = int(round(n * frac))
    sides = (n - n_test, n_test)  # training, test
    uniform_total = [int(round(m * s / 100.0)) for m in sides]
    parts, tests, test_parts = [], [], []
    for j in range(n_clients):
        # each side's images per class: first the spread part, then the dominant classes' share added
        train = _spread(uniform_total[0], classes, rng)
        # fewer spread training images than classes: the test side's spread goes to classes its training side holds
        # (a quickstart's 6 + 2 over 10 classes left most clients a test class they never trained on)
        held = np.array([c for c in classes if train[int(c)] > 0])
        test = {int(c): 0 for c in classes}
        test.update(_spread(uniform_total[1], held if 0 < len(held) < len(classes) else classes, rng))
        k = len(groups[j % len(groups)]) if groups is not None else min(dominant, len(classes))
        need = [np.diff(np.linspace(0, m - u, k + 1).astype(int)) for m, u in zip(sides, uniform_total)]
        if groups is not None:  # the client's fixed group (FedPAC's / FedeCouple's code); pop names an exhausted class
            chosen = np.array(groups[j % len(groups)])
        else:  # dominant classes are drawn at random among those that still hold enough images
            most = [int(need[0].max()) + max(train.values()), int(need[1].max()) + max(test.values())]
            lacks = [most[0] + most[1]] if len(pools) == 1 else most  # one pool serves both sides, or each its own
            able = [c for c in classes if all(len(free[i][int(c)]) >= m for i, m in enumerate(lacks))]
            if len(able) < k:
                raise SplitError(f"split (weak pathological): only {len(able)} classes still hold {' + '.join(map(str, lacks))} images at client {j}; lower samples_per_client or raise s")
            chosen = rng.choice(able, size=k, replace=False)
        for c, m_train, m_test in zip(chosen, need[0], need[1]):
            train[int(c)] += int(m_train)
            test[int(c)] += int(m_test)
        rows, test_rows = _take_sides(lambda side, c, m, j=j: pop(side, c, m, j), classes, train, test, test_labels is not None)
        parts.append(rows)
        test_parts.append(test_rows)
        tests.append(test)
    return parts, tests, (test_parts if test_labels is not None else None)


def _sized_dirichlet(labels: np.ndarray, n_clients: int, beta: float, n: int, frac: float, rng: np.random.Generator,
                     test_labels: Optional[np.ndarray] = None,
                     ) -> tuple[list[np.ndarray], list[dict[int, int]], Optional[list[np.ndarray]]]:
    """FedLab's balanced Dirichlet: every client ``n`` images, its class shares p_j ~ Dir(beta) over the classes; its
    training side (n - round(n frac)) and test side (round(n frac)) two draws of those shares (multinomial counts),
    each image taken from what its class still holds; where a class runs out, the client's remaining count goes to
    its other classes in proportion to their shares (FedLab's sampler zeroes an exhausted class's probability and
    renormalizes). Returns as :func:`_weak_pathological`: each client's rows, per class its test count, and, given
    the official test subset's labels, the test rows drawn from it (the first list then holds the training rows)."""
    classes = np.unique(labels)
    pools = [labels] if test_labels is None else [labels, test_labels]
    free = _class_pools(pools, classes, rng)
    n_test = int(round(n * frac))
    shares = rng.dirichlet(np.full(len(classes), beta), size=n_clients)

    def counts(side: int, m: int, p: np.ndarray, taken: np.ndarray, j: int) -> np.ndarray:
        """m images by shares p from pool ``side``, beside ``taken`` already asked of it for this client."""
        left = np.array([len(free[side][int(c)]) for c in classes]) - taken
        got = np.zeros(len(classes), dtype=np.int64)
        while got.sum() < m:
            q = np.where(left - got > 0, p, 0.0)
            if q.sum() <= 0:
                where = " of the official test subset" if side else ""
                raise SplitError(f"split (dirichlet, samples_per_client): client {j}'s classes run out of images{where}; "
                                 "lower samples_per_client or raise beta")
            got += np.minimum(rng.multinomial(m - got.sum(), q / q.sum()), left - got)
        return got

    def pop(side: int, c: int, m: int) -> list[int]:
        out, free[side][c] = free[side][c][:m], free[side][c][m:]
        return out

    parts, tests, test_parts = [], [], []
    for j in range(n_clients):
        train_n = counts(0, n - n_test, shares[j], np.zeros(len(classes), dtype=np.int64), j)
        test_n = counts(len(pools) - 1, n_test, shares[j], train_n if len(pools) == 1 else np.zeros_like(train_n), j)
        train, test = ({int(c): int(k) for c, k in zip(classes, side)} for side in (train_n, test_n))
        rows, test_rows = _take_sides(pop, classes, train, test, test_labels is not None)
        parts.append(rows)
        test_parts.append(test_rows)
        tests.append(test)
    return parts, tests, (test_parts if test_labels is not None else None)


def _train_test_by_group(records: pd.DataFrame, rows: np.ndarray, frac: float, rng: np.random.Generator,
                         n_test_of: Optional[dict[int, int]] = None) -> tuple[list[int], list[int]]:
    """Split one client's rows into train/test: per class, a ``frac`` share of its groups goes to test, or, given
    ``n_test_of`` (label -> test images), groups in a random order join the test side while it stays within the count
    (exact where every group is one image)."""
    sub = records.loc[rows]
    first_label = sub.groupby("group")["label"].first()
    size = sub.groupby("group").size() if n_test_of is not None else None
    train: list[int] = []
    test: list[int] = []
    for label, groups in first_label.groupby(first_label):
        names = sorted(groups.index)
        order = [names[i] for i in rng.permutation(len(names))]
        if n_test_of is None:
            n_test = int(round(frac * len(order))) if len(order) > 1 else 0
            test_groups = set(order[:n_test])
        else:
            test_groups, held = set(), 0
            for g in order:
                if held + size[g] <= n_test_of.get(int(label), 0):  # type: ignore[index]
                    test_groups.add(g)
                    held += int(size[g])
        for g in order:
            members = sub.index[sub["group"] == g].tolist()
            (test if g in test_groups else train).extend(members)
    return train, test


def label_skew(records: pd.DataFrame, params: LabelSkewSplit, seed: int) -> dict[str, Any]:
    doms = _domains(records, params.domains)
    pool = records[records["domain"].isin(doms)]
    test_pool = None
    if params.test_from == "official":  # the scheme deals the training subset; the test subset follows its classes
        for d in doms:
            _uses_official(pool[pool["domain"] == d], "official", d, "leave test_from out: pooled")
        is_test = (pool["subset"] == "test").to_numpy()
        pool, test_pool = pool[~is_test], pool[is_test]
    labels = pool["label"].to_numpy()
    test_labels = None if test_pool is None else test_pool["label"].to_numpy()
    rng = _rng(seed, "label_skew", params.scheme)
    n_tests: Optional[list[dict[int, int]]] = None
    if params.scheme == "dirichlet" and params.samples_per_client:
        parts, n_tests, test_parts = _sized_dirichlet(labels, params.clients, params.beta, params.samples_per_client,
                                                      params.test_fraction, rng, test_labels)
    elif params.scheme == "dirichlet":
        parts, test_parts = _dirichlet_parts(labels, params.clients, params.beta, params.min_per_client, rng, "split (dirichlet)", params.balance), None
    elif params.scheme == "pathological":
        parts, test_parts = _pathological(labels, params.clients, params.classes_per_client, rng, test_labels)
    elif params.scheme == "shards":
        parts, test_parts = _shards(labels, params.clients, params.classes_per_client, rng, test_labels)
    else:
        n = params.samples_per_client or len(pool) // params.clients
        parts, n_tests, test_parts = _weak_pathological(labels, params.clients, params.s, n, params.test_fraction, params.classes_per_client,
                                                        rng, params.dominant_groups, test_labels)
    index = pool.index.to_numpy()
    clients = []
    for j, part in enumerate(parts):
        rows = index[part]
        if test_parts is not None:  # official: the training side is the client's rows, its test side from the test subset
            train, test = rows.tolist(), test_pool.index.to_numpy()[test_parts[j]].tolist()
        else:
            train, test = _train_test_by_group(records, rows, params.test_fraction, rng, None if n_tests is None else n_tests[j])
        if not train or not test:
            raise SplitError(f"split: client {j} has {len(train)} training and {len(test)} test images; it needs both")
        # every client is a draw from the one pooled distribution: its domain is the pool's (a client that drew no image
        # of some domain would otherwise get a column of its own in the report)
        clients.append(_client(j, f"client{j:02d}", "+".join(sorted(doms)), train, test))
    return {"protocol": params.protocol, "seed": seed, "params": params.dump(), "num_classes": _num_classes(records), "clients": clients}


# --------------------------------------------------------------------------- domain incremental
def domain_incremental(records: pd.DataFrame, params: DomainIncrementalSplit, seed: int) -> dict[str, Any]:
    order = list(params.domain_order) if params.domain_order else list(dict.fromkeys(records["domain"]))
    _domains(records, tuple(order), "domain_order")
    tasks_per_client: list[list[dict[str, Any]]] = [[] for _ in range(params.clients)]
    official = []
    for t, dom in enumerate(order):
        sub = records[records["domain"] == dom]
        rng = _rng(seed, "domain_incremental", dom)
        if _uses_official(sub, params.test_from, dom):
            official.append(dom)
            train_pool, test_pool = sub[sub["subset"] != "test"], sub[sub["subset"] == "test"]
        else:
            groups = _shuffled_groups(sub, rng)
            n_test = max(1, int(round(params.test_fraction * len(groups))))
            test_rows = np.concatenate(groups[:n_test]) if n_test else np.array([], np.int64)
            test_pool, train_pool = sub.loc[np.sort(test_rows)], sub.drop(index=test_rows)
        if params.n_per_domain and len(train_pool) > params.n_per_domain:
            train_pool = train_pool.loc[np.sort(rng.choice(train_pool.index.to_numpy(), params.n_per_domain, replace=False))]
        # one Dirichlet draw per class gives each client its share; train and test use the same shares
        classes = np.unique(train_pool["label"])
        for _ in range(1000):
            shares = {int(c): rng.dirichlet(np.full(params.clients, params.alpha)) for c in classes}
            train_parts = _cut_by_shares(train_pool, shares, params.clients, rng)
            if min(len(p) for p in train_parts) >= params.min_per_client:
                break
        else:
            raise SplitError(f"domain {dom!r}: no Dirichlet draw gave every client {params.min_per_client} training images (raise alpha)")
        test_parts = _cut_by_shares(test_pool, shares, params.clients, rng)
        for j in range(params.clients):
            tasks_per_client[j].append({"task": t, "domain": dom, "train": sorted(train_parts[j]), "test": sorted(test_parts[j])})
    if official and "test_fraction" in params.model_fields_set:  # set, and passed over where a domain has its own test
        log.warning("split.test_fraction %g is not used for %s: %s its official test subset (test_from: %s); test_from: "
                    "pooled draws test_fraction of every domain's images", params.test_fraction, ", ".join(official),
                    "each takes" if len(official) > 1 else "it takes", params.test_from)
    names = list(params.names) if params.names else [f"client{j:02d}" for j in range(params.clients)]
    clients = [{"client": j, "name": names[j], "tasks": tasks} for j, tasks in enumerate(tasks_per_client)]
    return {
        "protocol": params.protocol, "seed": seed, "params": params.model_dump(mode="json"), "num_classes": _num_classes(records),
        "task_order": order, "clients": clients,
    }


def _cut_by_shares(pool: pd.DataFrame, shares: dict[int, np.ndarray], n: int, rng: np.random.Generator) -> list[list[int]]:
    parts: list[list[int]] = [[] for _ in range(n)]
    for c, p in shares.items():
        # a copy: pandas' copy-on-write hands out read-only arrays, and numpy refuses to permute an empty read-only
        # one (a class with no image on one side of a pooled domain, e.g. an Office-31 class in a small test pool)
        idx = rng.permutation(pool.index[pool["label"] == c].to_numpy(copy=True))
        for j, chunk in enumerate(_cut(idx, p)):
            parts[j].extend(int(i) for i in chunk)
    return parts


# --------------------------------------------------------------------------- holdout
def holdout_domain(records: pd.DataFrame, params: HoldoutDomainSplit, seed: int) -> dict[str, Any]:
    doms = _domains(records, params.domains)
    _domains(records, (params.holdout,), "holdout")
    if len([d for d in doms if d != params.holdout]) < 1:
        raise SplitError("split.holdout: no domain left for the federation")
    out = domain_clients(records, params, seed, exclude=(params.holdout,))
    dom = params.holdout
    n_test = params.n_test_per_domain.get(dom, params.n_test or params.n_train)
    if params.role == "newcomer":
        train, test, _ = _draw_domain(records, dom, params.n_train, n_test, params.test_from, seed)
    else:  # external test: the whole domain unless a test size is given
        sub = records[records["domain"] == dom]
        train = []
        sized = params.n_test is not None or dom in params.n_test_per_domain
        test = _take(_shuffled_groups(sub, _rng(seed, dom)), n_test)[0] if sized else sub.index.tolist()
    out["holdout"] = {"domain": dom, "role": params.role, "client": _client(len(out["clients"]), dom, dom, train, test)}
    return out


# --------------------------------------------------------------------------- by_writer
def _client_name(writer: str) -> str:
    """A writer id as a client name (metric keys, MLflow): characters other than letters, digits, ``_ . -`` become ``_``."""
    return "".join(ch if ch.isalnum() or ch in "_.-" else "_" for ch in writer) or "writer"


def _leaf_sample_split(rows: np.ndarray, test_fraction: float, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """LEAF's ``split_data.py --by_sample`` for one writer: max(1, floor((1 - test_fraction) x n)) images drawn for
    training (one of two when n = 2), the rest for testing."""
    n = len(rows)
    n_train = 1 if n == 2 else max(1, int((1.0 - test_fraction) * n))
    picked = np.zeros(n, dtype=bool)
    picked[rng.choice(n, size=n_train, replace=False)] = True
    return rows[picked].tolist(), rows[~picked].tolist()


def by_writer(records: pd.DataFrame, params: ByWriterSplit, seed: int) -> dict[str, Any]:
    if "writer" not in records.columns or not records["writer"].astype(bool).any():
        raise SplitError("split.protocol: by_writer needs records that name their writer (a source such as femnist); "
                         "this dataset's records have no writer column")
    by_w = records.groupby("writer", sort=True).indices
    eligible = [str(w) for w, rows in by_w.items() if w and len(rows) >= params.min_samples]
    want = params.clients if params.clients is not None else len(eligible)
    if want > len(eligible):
        raise SplitError(f"split.clients: {want} writers asked for, {len(eligible)} have at least split.min_samples = "
                         f"{params.min_samples} images")
    rng = _rng(seed, "by_writer")
    chosen = [eligible[i] for i in sorted(rng.choice(len(eligible), size=want, replace=False))]
    names = [_client_name(w) for w in chosen]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise SplitError(f"split: two writers become the client name {dup!r}")
    own_split = bool(records["subset"].isin(["train", "test"]).any())
    clients = []
    for j, (w, name) in enumerate(zip(chosen, names)):
        rows = np.sort(records.index.to_numpy()[by_w[w]])
        subset = records.loc[rows, "subset"].to_numpy()
        if (subset == "train").any() and (subset == "test").any():  # the data's own split (LEAF -t sample)
            train, test = rows[subset == "train"].tolist(), rows[subset == "test"].tolist()
        elif own_split:  # LEAF's -t user: whole writers on one side, not a client's train and test
            raise SplitError(f"split.protocol: by_writer: writer {w!r} has only {sorted(set(subset) - {''})} images in a "
                             "dataset with its own train / test split (LEAF's -t user puts whole writers on one side); "
                             "rebuild it with LEAF's -t sample, or from all_data")
        else:
            train, test = _leaf_sample_split(rows, params.test_fraction, _rng(seed, "by_writer", w))
        clients.append(_client(j, name, str(records.loc[rows[0], "domain"]), train, test))
    return {"protocol": params.protocol, "seed": seed, "params": params.model_dump(mode="json"), "num_classes": _num_classes(records), "clients": clients}


def make_split(records: pd.DataFrame, params: Any, seed: int) -> dict[str, Any]:
    fn = {
        "domain_clients": domain_clients,
        "domain_multi_clients": domain_multi_clients,
        "label_skew": label_skew,
        "domain_incremental": domain_incremental,
        "holdout_domain": holdout_domain,
        "by_writer": by_writer,
    }.get(params.protocol)
    if fn is None:  # pragma: no cover - config validation rejects other protocols
        raise SplitError(f"split.protocol: {params.protocol!r} is not implemented")
    return fn(records, params, seed)


def settings_differ(split: dict[str, Any], params: Any) -> list[str]:
    """What a split file was built with that an experiment's split block (``params``) no longer says: one
    'key: built with X, now Y' per setting. A setting the file does not record was at its default when it was built
    (splits leave a setting at its default out, so that files made before it existed keep their bytes); a setting the
    file records that the block no longer has is not looked at."""
    from pydantic_core import to_jsonable_python

    out = [f"protocol: built with {split.get('protocol')}, now {params.protocol}"] if split.get("protocol") != params.protocol else []
    built = split.get("params")
    if not isinstance(built, dict) or out:
        return out
    fields = type(params).model_fields
    for key, now in params.model_dump(mode="json").items():
        was = built[key] if key in built else to_jsonable_python(fields[key].get_default(call_default_factory=True))
        if was != now:
            out.append(f"{key}: built with {was!r}, now {now!r}")
    return out


def refuse_stale_split(split: dict[str, Any], params: Any, path: Any, experiment: str, rerun: str) -> None:
    """ConfigError when the split file at ``path`` was built with other settings than ``experiments.<experiment>.split``
    (``params``) has now (:func:`settings_differ`), naming each and ``rerun``, the command that builds it again."""
    from fedsilo.config import ConfigError

    stale = settings_differ(split, params)
    if stale:
        raise ConfigError(f"{path}: built with other settings than experiments.{experiment}.split has now "
                          f"({'; '.join(stale)}); rerun {rerun}")


def iter_sides(split: dict[str, Any]):
    """(label, train rows, test rows) for every client, task and held-out client of a split."""
    for c in split["clients"]:
        if "tasks" in c:
            for t in c["tasks"]:
                yield f"{c['name']} task {t['task']}", t["train"], t["test"]
        else:
            yield c["name"], c["train"], c["test"]
    if "holdout" in split:
        h = split["holdout"]["client"]
        yield f"{h['name']} (held out)", h["train"], h["test"]


def check_patient_disjoint(records: pd.DataFrame, split: dict[str, Any]) -> None:
    for name, train, test in iter_sides(split):
        both = set(records.loc[train, "group"]) & set(records.loc[test, "group"])
        if both:
            raise SplitError(f"client {name}: patient(s) {sorted(both)[:3]} in both train and test")


def dataset_domains(params: Any, name: str) -> Optional[list[str]]:
    """The domains a dataset's images will carry, where params alone say: a chest X-ray dataset's sources' (a table's
    ``domain``, default its source's name), a benchmark's public sources' own (each reader's ``DOMAINS``), kept to
    ``datasets.<d>.domains``; None where folders or tables of the user's decide (a benchmark's sources of your own)."""
    from fedsilo.config import CXRDatasetParams
    from fedsilo.data.sources import source_module

    d = params.datasets.get(name)
    if d is None:
        return None
    if isinstance(d, CXRDatasetParams):
        doms = [x for s in d.sources for x in d.domains_of(s)]
    else:
        if d.own_sources():
            return None
        doms = []
        for s in d.source_list:
            found = getattr(source_module(s), "DOMAINS", None)
            if found is None:
                return None
            doms += list(found)
    keep = getattr(d, "domains", None)
    return [x for x in dict.fromkeys(doms) if not keep or x in keep]


def check_split_domains(params: Any, source: str) -> None:
    """``fedsilo check-params``: every domain a trained experiment's split names (``domains``, ``domain_order``,
    ``holdout``, the keys of ``clients_per_domain`` and ``n_test_per_domain``) is a domain of its dataset, where params
    alone tell them (:func:`dataset_domains`): a misspelt domain stopped the split stage, after DVC had started."""
    for e in dict.fromkeys([*params.pipeline.experiments, *params.pipeline.splits]):
        if e not in params.experiments:
            continue
        exp = params.experiments[e]
        have = dataset_domains(params, exp.dataset)
        if not have:
            continue
        sp = exp.split
        named = {key: list(getattr(sp, key, None) or ()) for key in ("domains", "domain_order", "clients_per_domain", "n_test_per_domain")}
        if getattr(sp, "holdout", None):
            named["holdout"] = [sp.holdout]
        for key, doms in named.items():
            for dom in doms:
                if dom not in have:
                    raise SplitError(f"{source}: experiments.{e}.split.{key}: {dom!r} is not a domain of datasets.{exp.dataset}"
                                     f"{did_you_mean(dom, have)} (its domains: {', '.join(have)})")
