"""Every split protocol of DESIGN §4: purity, disjointness, sizes, class coverage, concentration, task order."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from fedsilo.config import (
    DomainClientsSplit,
    DomainIncrementalSplit,
    DomainMultiClientsSplit,
    HoldoutDomainSplit,
    LabelSkewSplit,
)
from fedsilo.data.splits import SplitError, check_patient_disjoint, iter_sides, make_split


@pytest.fixture(scope="module")
def records() -> pd.DataFrame:
    """A synthetic record table: 4 domains x 10 classes, official train/test subsets on two domains, patient groups
    of 1-3 images on another."""
    rng = np.random.default_rng(0)
    rows = []
    for dom in ("A", "B", "C", "D"):
        for i in range(400):
            label = int(rng.integers(0, 10))
            group = f"{dom}/p{i // 3}" if dom == "C" else f"{dom}/{i}"
            subset = ("test" if i % 4 == 0 else "train") if dom in ("A", "B") else ""
            rows.append({"id": f"{dom}/{i}", "domain": dom, "label": label, "group": group, "subset": subset})
    return pd.DataFrame(rows)


def _dump(s) -> str:
    return json.dumps(s, sort_keys=True)


PROTOCOLS = [
    DomainClientsSplit(n_train=60, n_test=40),
    DomainMultiClientsSplit(protocol="domain_multi_clients", clients_per_domain={"A": 3, "B": 2, "C": 2, "D": 3}, fraction=0.2),
    LabelSkewSplit(protocol="label_skew", clients=8, scheme="dirichlet", beta=0.3),
    LabelSkewSplit(protocol="label_skew", clients=8, scheme="pathological", classes_per_client=3),
    LabelSkewSplit(protocol="label_skew", clients=8, scheme="weak_pathological", s=20, samples_per_client=120, classes_per_client=1),
    DomainIncrementalSplit(protocol="domain_incremental", clients=5, alpha=0.5, domain_order=("D", "B", "A", "C")),
    HoldoutDomainSplit(protocol="holdout_domain", holdout="C", n_train=60, n_test=40),
]


@pytest.mark.parametrize("params", PROTOCOLS, ids=lambda p: f"{p.protocol}-{getattr(p, 'scheme', '')}")
def test_pure_function_of_params_and_seed_and_group_disjoint(records, params):
    a, b, c = make_split(records, params, 1), make_split(records, params, 1), make_split(records, params, 2)
    assert _dump(a) == _dump(b) and _dump(a) != _dump(c)
    check_patient_disjoint(records, a)
    for name, train, test in iter_sides(a):
        assert len(set(train)) == len(train) and not set(train) & set(test), name


@pytest.mark.parametrize("params", PROTOCOLS + [
    DomainClientsSplit(n_train=60, n_test=40, n_val=10),
    DomainMultiClientsSplit(protocol="domain_multi_clients", clients_per_domain={"amazon": 2, "dslr": 2}, fraction=0.2,
                            test_from="pooled", test_select="listing", every_class=True),
], ids=lambda p: f"{p.protocol}-{getattr(p, 'scheme', '')}")
def test_a_split_file_tells_the_settings_it_was_built_with_from_edited_ones(records, params):
    """A split made from a block matches that block (the settings left out of the file at their defaults too); an
    edit of the block since, a setting back at its default included, is named (train and a site's card refuse the
    file then)."""
    from fedsilo.data.splits import settings_differ

    recs = _office_like() if getattr(params, "test_select", "seeded") == "listing" else records
    split = make_split(recs, params, params.seed)
    assert settings_differ(split, params) == []
    edits = {"domain_clients": {"n_train": 50}, "domain_multi_clients": {"fraction": 0.1}, "label_skew": {"clients": 7},
             "domain_incremental": {"clients": 4}, "holdout_domain": {"n_test": 30}}[params.protocol]
    for key, value in {**edits, "seed": params.seed + 1}.items():
        assert settings_differ(split, params.model_copy(update={key: value})) == [f"{key}: built with {getattr(params, key)!r}, now {value!r}"]
    if getattr(params, "every_class", False):  # a setting the file records, set back to its default: named too
        assert settings_differ(split, params.model_copy(update={"every_class": False})) == ["every_class: built with True, now False"]
    if getattr(params, "n_val", 0):
        assert settings_differ(split, params.model_copy(update={"n_val": 0})) == ["n_val: built with 10, now 0"]


def test_domain_clients_uses_official_test_subset_when_present(records):
    s = make_split(records, DomainClientsSplit(n_train=60, n_test=40), 0)
    by = {c["name"]: c for c in s["clients"]}
    assert set(records.loc[by["A"]["test"], "subset"]) == {"test"} and set(records.loc[by["A"]["train"], "subset"]) == {"train"}
    pooled = make_split(records, DomainClientsSplit(n_train=60, n_test=40, test_from="pooled"), 0)
    assert set(records.loc[pooled["clients"][0]["test"], "subset"]) == {"train", "test"}
    with pytest.raises(SplitError, match="domain 'C' has no official test subset"):
        make_split(records, DomainClientsSplit(n_train=6, test_from="official"), 0)
    # a copy holding a domain's test subset only (MNIST's test set alone): the error names the empty training pool
    only_test = records.assign(subset=records["subset"].where(records["domain"] != "A", "test"))
    with pytest.raises(SplitError, match=r"domain 'A': the official test subset holds \d+ of its \d+ images and leaves 0 "
                       r"\(0 groups\) to train on: not 60 train .* needs test_from: pooled"):
        make_split(only_test, DomainClientsSplit(n_train=60, n_test=40), 0)


def test_domain_clients_n_test_all_takes_the_whole_official_test_subset(records):
    """FedBN's Digits protocol and the released Chest-X-Ray-4: the whole official test subset, whatever its size."""
    s = make_split(records, DomainClientsSplit(n_train=60, n_test="all", domains=("A", "B")), 0)
    for c in s["clients"]:
        official = set(records.index[(records["domain"] == c["domain"]) & (records["subset"] == "test")])
        assert set(c["test"]) == official and len(official) > 60
    with pytest.raises(SplitError, match="split.n_test: 'all' takes domain 'C'"):
        make_split(records, DomainClientsSplit(n_train=60, n_test="all"), 0)
    with pytest.raises(ValueError, match="n_test"):
        DomainClientsSplit(n_train=60, n_test="most")


def test_domain_multi_clients_sizes_disjoint_and_shared_test(records):
    p = PROTOCOLS[1]
    s = make_split(records, p, 0)
    assert [c["name"] for c in s["clients"]] == ["A-0", "A-1", "A-2", "B-0", "B-1", "C-0", "C-1", "D-0", "D-1", "D-2"]
    for dom in p.clients_per_domain:
        cs = [c for c in s["clients"] if c["domain"] == dom]
        trains = [set(c["train"]) for c in cs]
        assert all(not (x & y) for i, x in enumerate(trains) for y in trains[i + 1 :]), "clients of a domain are disjoint"
        pool = 300 if dom in ("A", "B") else 320  # A/B: official train pool; others: 80 % kept for training
        assert all(abs(len(t) - int(0.2 * pool)) <= 2 for t in trains)
        assert all(c["test"] == cs[0]["test"] for c in cs) and set(records.loc[cs[0]["train"], "domain"]) == {dom}
    with pytest.raises(SplitError, match="6 clients x fraction 0.2 > 1"):
        make_split(records, DomainMultiClientsSplit(protocol="domain_multi_clients", clients_per_domain={"A": 6}, fraction=0.2), 0)


def _client_label_counts(records, split) -> np.ndarray:
    return np.stack([np.bincount(records.loc[c["train"] + c["test"], "label"], minlength=10) for c in split["clients"]])


def test_dirichlet_concentration_behaves_as_beta_says(records):
    """Smaller beta -> more concentrated clients: lower mean label entropy, on average over seeds."""
    def mean_entropy(beta):
        out = []
        for seed in range(4):
            counts = _client_label_counts(records, make_split(records, LabelSkewSplit(protocol="label_skew", clients=8, scheme="dirichlet", beta=beta), seed))
            p = counts / counts.sum(1, keepdims=True)
            out.append(-(p * np.log(np.where(p > 0, p, 1.0))).sum(1).mean())
        return float(np.mean(out))

    h01, h1, h100 = mean_entropy(0.1), mean_entropy(1.0), mean_entropy(100.0)
    assert h01 < h1 < h100 and h100 > 0.95 * np.log(10)


def test_dirichlet_covers_every_image_once(records):
    s = make_split(records, PROTOCOLS[2], 0)
    rows = [i for c in s["clients"] for i in c["train"] + c["test"]]
    assert sorted(rows) == list(range(len(records)))
    assert min(len(c["train"]) + len(c["test"]) for c in s["clients"]) >= 10


def test_balanced_dirichlet_stops_dealing_to_a_client_that_holds_its_share():
    """NIID-Bench's / PFLlib's rule: replaying the classes in the order they are dealt, no client receives a class
    once it already holds len(pool) / clients images; that is what lets beta = 0.01 give 20 clients images on 10
    classes of CIFAR-10's size (the plain draw cannot: about one client takes each class)."""
    from fedsilo.data.splits import _dirichlet_parts

    labels = np.random.default_rng(1).permutation(np.repeat(np.arange(10), 6000))
    with pytest.raises(SplitError, match="no Dirichlet draw in 1000"):
        _dirichlet_parts(labels, 20, 0.01, 10, np.random.default_rng(0), "split (dirichlet)")
    parts = _dirichlet_parts(labels, 20, 0.01, 10, np.random.default_rng(0), "split (dirichlet)", balance=True)
    counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])
    assert counts.sum(1).min() >= 10 and sorted(np.concatenate(parts)) == list(range(len(labels)))
    held_before = np.cumsum(counts, axis=1) - counts  # images of the classes dealt before each class (0..9 in order)
    assert (held_before[counts > 0] < len(labels) / 20).all()


def test_balanced_dirichlet_redraws_when_every_client_below_its_share_drew_zero():
    """Dir(0.01) draws exact zeros (~7 % of components): when the clients still below their share all drew 0 for a
    class, the draw cannot place it and is redrawn (dividing by the zero sum gave NaN shares)."""
    from fedsilo.data.splits import _dirichlet_parts

    class Draws:  # the first attempt gives client 0 class 0 whole, then draws zero for client 1 on class 1
        def __init__(self):
            self.shares = iter([[1.0, 0.0], [1.0, 0.0], [0.5, 0.5], [0.5, 0.5]])

        def permutation(self, x):
            return np.asarray(x)

        def dirichlet(self, alpha):
            return np.array(next(self.shares))

    labels = np.repeat(np.arange(2), 10)
    parts = _dirichlet_parts(labels, 2, 0.01, 1, Draws(), "split (dirichlet)", balance=True)
    # the redraw's halves, not the first attempt's NaN cut (which happened to hand client 1 the whole class)
    assert parts[0].tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14] and sorted(np.concatenate(parts)) == list(range(20))


def test_pathological_gives_exactly_k_classes_and_covers_all(records):
    s = make_split(records, PROTOCOLS[3], 0)
    counts = _client_label_counts(records, s)
    assert ((counts > 0).sum(1) == 3).all()
    assert (counts.sum(0) > 0).all(), "every class is held by some client"
    for c in s["clients"]:  # train and test hold the same classes
        assert set(records.loc[c["train"], "label"]) == set(records.loc[c["test"], "label"])


def test_weak_pathological_has_s_percent_uniform_and_a_dominant_class(records):
    """120 images, a quarter test: 90 training images (18 spread over the 10 classes, 72 of the dominant class) and 30
    test (6 spread, 24 dominant), each side drawn with the mixture."""
    s = make_split(records, PROTOCOLS[4], 0)
    counts = _client_label_counts(records, s)
    assert (counts.sum(1) == 120).all()
    labels = records["label"].to_numpy()
    for c, row in zip(s["clients"], counts):
        dom = int(row.argmax())
        for side, n, spread in (("train", 90, 18), ("test", 30, 6)):
            per = np.bincount(labels[c[side]], minlength=10)
            assert per.sum() == n
            others = np.delete(per, dom)  # each class's share of the spread part: its whole part, or one less
            assert others.max() - others.min() <= 1 and n - spread <= per[dom] <= n - spread + others.max() + 1


def test_weak_pathological_keeps_s_percent_on_both_sides_with_many_classes():
    """100 classes at s = 20 %: 1.8 spread images a class do not round per class (CIFAR-100: the per-class split of a
    client's 900 images left 570 training images 17.5 % uniform and 330 test images 30 %)."""
    recs = pd.DataFrame({"id": [f"x{i}" for i in range(6000)], "domain": "A", "label": np.arange(6000) % 100,
                         "group": [f"g{i}" for i in range(6000)], "subset": ""})
    groups = tuple(tuple(range(10 * g, 10 * g + 10)) for g in range(10))
    p = LabelSkewSplit(protocol="label_skew", clients=10, scheme="weak_pathological", s=20, samples_per_client=90,
                       test_fraction=1 / 3, dominant_groups=groups)
    s = make_split(recs, p, 0)
    shares = {"train": [], "test": []}
    for j, c in enumerate(s["clients"]):
        assert (len(c["train"]), len(c["test"])) == (60, 30)
        for side in shares:
            shares[side].append(np.mean([lab not in groups[j] for lab in recs.loc[c[side], "label"]]))
    # 12 of 60 training and 6 of 30 test images spread over 100 classes: 90 % of them off the client's 10 dominant
    assert np.mean(shares["train"]) == pytest.approx(0.18, abs=0.03)
    assert np.mean(shares["test"]) == pytest.approx(0.18, abs=0.03)


def test_weak_pathological_test_side_holds_no_class_its_training_side_lacks(records):
    """40 images a quarter test at s = 20 %: 6 spread training images and 2 spread test images over 10 classes; the
    test's go to classes the training side holds (drawn apart, most clients tested a class they never trained on)."""
    p = LabelSkewSplit(protocol="label_skew", clients=10, scheme="weak_pathological", s=20, samples_per_client=40,
                       dominant_groups=((0, 1, 2), (2, 3, 4), (4, 5, 6), (6, 7, 8), (8, 9, 0)))
    for seed in range(3):
        for c in make_split(records, p, seed)["clients"]:
            train, test = set(records.loc[c["train"], "label"]), set(records.loc[c["test"], "label"])
            assert (len(c["train"]), len(c["test"])) == (30, 10) and test <= train, (seed, c["name"], test - train)


def test_weak_pathological_fixed_groups_give_each_client_its_groups_classes(records):
    """FedPAC's and FedeCouple's code: client j's dominant classes are group j mod 5, not a random draw."""
    groups = ((0, 1, 2), (2, 3, 4), (4, 5, 6), (6, 7, 8), (8, 9, 0))
    p = LabelSkewSplit(protocol="label_skew", clients=8, scheme="weak_pathological", s=20, samples_per_client=60, dominant_groups=groups)
    counts = _client_label_counts(records, make_split(records, p, 0))
    for j, row in enumerate(counts):  # 12 images spread over 10 classes, 48 over the group's 3
        assert row.sum() == 60
        dominant = {int(c) for c in np.flatnonzero(row > 2)}
        assert dominant == set(groups[j % 5]) and (row[list(dominant)] >= 16).all(), (j, row)
    with pytest.raises(SplitError, match="dominant_groups"):
        make_split(records, p.model_copy(update={"dominant_groups": ((0, 1, 12),)}), 0)


def test_shards_give_at_most_s_classes_and_deal_every_image(records):
    """FedAvg's / LG-FedAvg's shards (CD2-pFed): K s shard slots over the classes, a client may draw a class twice."""
    p = LabelSkewSplit(protocol="label_skew", clients=10, scheme="shards", classes_per_client=2, domains=("A", "B"))
    pool = records[records["domain"].isin(["A", "B"])]
    fewer = 0
    for seed in range(4):
        s = make_split(records, p, seed)
        held = [c["train"] + c["test"] for c in s["clients"]]
        assert sorted(i for h in held for i in h) == sorted(pool.index)  # every image dealt once
        for h in held:
            n_classes = records.loc[h, "label"].nunique()
            assert n_classes <= 2
            fewer += n_classes < 2
        # each class cut into K s / C = 2 shards of near-equal size: a client's share of a class is about half of it
        counts = _client_label_counts(records, s)
        totals = pool["label"].value_counts().sort_index().to_numpy()
        for c in range(10):
            assert set(counts[:, c][counts[:, c] > 0]) <= {totals[c] // 2, totals[c] - totals[c] // 2, totals[c]}
    assert fewer > 0, "some client drew one class twice (at most s classes, not exactly s)"
    with pytest.raises(SplitError, match=r"classes_per_client.*multiple of the 10 classes"):
        make_split(records, p.model_copy(update={"clients": 7}), 0)


@pytest.mark.parametrize("scheme", ["pathological", "shards", "weak_pathological"])
def test_label_skew_official_test_side_comes_from_the_test_subset_with_the_clients_classes(records, scheme):
    extra = {"samples_per_client": 40, "test_fraction": 0.25, "s": 20} if scheme == "weak_pathological" else {}
    p = LabelSkewSplit(protocol="label_skew", clients=10, scheme=scheme, classes_per_client=2, domains=("A", "B"),
                       test_from="official", **extra)
    s = make_split(records, p, 0)
    assert s["params"]["test_from"] == "official"
    subset = records["subset"]
    for c in s["clients"]:
        assert (subset[c["train"]] != "test").all() and (subset[c["test"]] == "test").all()
        train_classes, test_classes = set(records.loc[c["train"], "label"]), set(records.loc[c["test"], "label"])
        if scheme == "weak_pathological":  # 30 training and 10 test images, each side 20 % spread and its dominant classes
            assert (len(c["train"]), len(c["test"])) == (30, 10)
        else:
            assert test_classes <= train_classes
    if scheme == "shards":  # every official test image dealt with the training shards' classes
        assert sorted(i for c in s["clients"] for i in c["test"]) == sorted(records.index[(subset == "test") & records["domain"].isin(["A", "B"])])
    with pytest.raises(SplitError, match=r"test_from: domain 'C' has no official test subset \(leave test_from out: pooled\)"):
        make_split(records, p.model_copy(update={"domains": ("A", "C")}), 0)


@pytest.mark.parametrize("test_from", ["pooled", "official"])
def test_sized_dirichlet_gives_every_client_its_images_with_its_own_class_shares(records, test_from):
    """FedeCouple's Table VI (FedLab's balanced Dirichlet): with samples_per_client every client holds that many
    images, training and test sides drawn with the client's own Dir(beta) class shares (the test side from the
    official test subset with test_from: official); smaller beta, fewer classes a client; no image twice."""
    doms = ("A", "B") if test_from == "official" else None
    p = LabelSkewSplit(protocol="label_skew", clients=8, scheme="dirichlet", beta=0.1, samples_per_client=40,
                       test_fraction=0.25, domains=doms, test_from=test_from)
    s = make_split(records, p, 0)
    assert all((len(c["train"]), len(c["test"])) == (30, 10) for c in s["clients"])
    rows = [i for c in s["clients"] for i in c["train"] + c["test"]]
    assert len(rows) == len(set(rows))
    if test_from == "official":
        assert all((records.loc[c["test"], "subset"] == "test").all() and (records.loc[c["train"], "subset"] != "test").all()
                   for c in s["clients"])
    def classes(beta):  # the mean number of classes holding 10 % of a client's training images
        split = make_split(records, p.model_copy(update={"beta": beta}), 1)
        return np.mean([(np.bincount(records.loc[c["train"], "label"], minlength=10) >= 3).sum() for c in split["clients"]])
    assert classes(0.1) < classes(100.0)
    # the sides share the client's shares: its test images fall on the classes it trains on most (where no class of
    # the pool runs out: the synthetic official test subset holds 20 images a class)
    for c in s["clients"] if test_from == "pooled" else []:
        train = np.bincount(records.loc[c["train"], "label"], minlength=10)
        test = np.bincount(records.loc[c["test"], "label"], minlength=10)
        assert train[test.argmax()] >= 3, (train, test)
    with pytest.raises(SplitError, match=r"split \(dirichlet, samples_per_client\): client \d+'s classes run out of images"):
        make_split(records, p.model_copy(update={"samples_per_client": 400}), 0)
    with pytest.raises(ValueError, match="balance: NIID-Bench's rule"):
        LabelSkewSplit(protocol="label_skew", clients=4, scheme="dirichlet", samples_per_client=40, balance=True)


def test_label_skew_official_is_refused_for_dirichlet_and_pooled_splits_record_no_test_from_key(records):
    with pytest.raises(ValueError, match="dirichlet without samples_per_client pools the images"):
        LabelSkewSplit(protocol="label_skew", clients=4, scheme="dirichlet", test_from="official")
    with pytest.raises(ValueError, match="samples_per_client: weak pathological with test_from: official"):
        LabelSkewSplit(protocol="label_skew", clients=4, scheme="weak_pathological", test_from="official")
    s = make_split(records, PROTOCOLS[3], 0)
    assert "test_from" not in s["params"]  # a split made before the key existed is the same file


def test_domain_incremental_task_order_and_per_domain_skew(records):
    s = make_split(records, PROTOCOLS[5], 0)
    assert s["task_order"] == ["D", "B", "A", "C"]
    for c in s["clients"]:
        assert [t["domain"] for t in c["tasks"]] == ["D", "B", "A", "C"] and [t["task"] for t in c["tasks"]] == [0, 1, 2, 3]
        for t in c["tasks"]:
            assert set(records.loc[t["train"] + t["test"], "domain"]) <= {t["domain"]}
    for t in range(4):  # a domain's training pool is partitioned among the clients
        trains = [set(c["tasks"][t]["train"]) for c in s["clients"]]
        assert sum(len(x) for x in trains) == len(set().union(*trains))
    with pytest.raises(Exception, match=r"split\.domain_order: domain 'Z' has no images \(have: "):
        make_split(records, DomainIncrementalSplit(protocol="domain_incremental", clients=3, domain_order=("A", "Z")), 0)


def test_domain_incremental_takes_a_class_missing_from_one_side_of_a_pooled_domain():
    """A class with a single image lands on one side only (Office-31's rare classes in a small pool): its other side
    is empty, which numpy refused to permute when pandas handed it out read-only."""
    rows = [{"id": f"E/{i}", "domain": "E", "label": i % 5, "group": f"E/{i}", "subset": ""} for i in range(40)]
    rows.append({"id": "E/rare", "domain": "E", "label": 5, "group": "E/rare", "subset": ""})
    s = make_split(pd.DataFrame(rows), DomainIncrementalSplit(protocol="domain_incremental", clients=2, min_per_client=1), 0)
    (task,) = s["clients"][0]["tasks"]
    assert sum(len(c["tasks"][0]["train"]) + len(c["tasks"][0]["test"]) for c in s["clients"]) == 41 and task["domain"] == "E"


def test_holdout_domain_keeps_the_domain_out_of_the_federation(records):
    s = make_split(records, PROTOCOLS[6], 0)
    assert [c["name"] for c in s["clients"]] == ["A", "B", "D"]
    h = s["holdout"]
    assert h["domain"] == "C" and h["role"] == "newcomer" and len(h["client"]["train"]) == 60
    assert set(records.loc[h["client"]["train"] + h["client"]["test"], "domain"]) == {"C"}
    whole = make_split(records, HoldoutDomainSplit(protocol="holdout_domain", holdout="C", role="external_test", n_train=60), 0)
    assert whole["holdout"]["client"]["train"] == [] and len(whole["holdout"]["client"]["test"]) == 400
    ext = make_split(records, HoldoutDomainSplit(protocol="holdout_domain", holdout="C", role="external_test", n_train=60, n_test=40), 0)
    assert len(ext["holdout"]["client"]["test"]) == 40
    # the federation's clients are identical whether the held-out domain is a newcomer or an external test set
    assert ext["clients"] == s["clients"]


def test_fedbn_sizes_come_from_the_smallest_domain(records):
    """FedBN's Office / DomainNet loaders: every client trains on floor(0.5 m) and validates on floor(0.4 m) images,
    m the smallest domain's training pool; the test set is the whole official test subset, or test_fraction of a
    domain without one. Train, validation and test are disjoint."""
    sub = records[records["domain"] != "D"].copy()
    sub = sub[~((sub["domain"] == "B") & (sub.index % 7 == 0))]  # B: the smallest training pool
    s = make_split(sub, DomainClientsSplit(n_train_of_smallest=0.5, n_val_of_smallest=0.4, test_fraction=0.2), 0)
    pools = {d: int((sub[(sub["domain"] == d)]["subset"] != "test").sum()) if d in ("A", "B") else len(sub[sub["domain"] == d]) - 80
             for d in ("A", "B", "C")}
    m = min(pools.values())
    assert m == pools["B"]
    for c in s["clients"]:
        dom = sub[sub["domain"] == c["domain"]]
        assert (len(c["train"]), len(c["val"])) == (m // 2, int(0.4 * m))
        assert len(c["test"]) == (int((dom["subset"] == "test").sum()) if c["domain"] in ("A", "B") else 80)
        assert not set(c["train"]) & set(c["val"]) and not (set(c["train"]) | set(c["val"])) & set(c["test"])
    assert "n_train_of_smallest" in s["params"] and "test_fraction" in s["params"]
    assert "n_train_of_smallest" not in make_split(sub, DomainClientsSplit(n_train=20), 0)["params"]  # older splits: same bytes
    with pytest.raises(SplitError, match="split.test_fraction: domain 'C' has no official test subset"):
        make_split(sub, DomainClientsSplit(n_train_of_smallest=0.5), 0)
    with pytest.raises(ValueError, match="n_train: not with n_train_of_smallest"):
        DomainClientsSplit(n_train=10, n_train_of_smallest=0.5)


def test_label_skew_clients_are_draws_from_one_pool_and_name_it(records):
    """Every label-skew client is a draw from the pooled domains: its domain is the pool's, also when it drew no image
    of one of them (the report would otherwise give such a client a column of its own)."""
    pool = records[records["domain"].isin(["A", "B"]) & (records["label"] < 2)].copy()
    pool.loc[pool.index[(pool["domain"] == "B").to_numpy()], "label"] = 1  # B holds class 1 only
    split = make_split(pool, LabelSkewSplit(protocol="label_skew", clients=4, scheme="pathological", classes_per_client=1,
                                            domains=("A", "B"), min_per_client=1), seed=0)
    drew = [set(pool.loc[c["train"] + c["test"], "domain"]) for c in split["clients"]]
    assert {"A"} in drew, "a client holding class 0 drew from A only"
    assert {c["domain"] for c in split["clients"]} == {"A+B"}


def test_domain_incremental_alpha_sets_the_label_skew_inside_every_domain(records):
    """Dirichlet(alpha) per domain: a client's label entropy grows with alpha, and its test side follows its train
    side's label distribution (the test images of a domain are spread with the same proportions)."""

    def hist(rows):
        return np.bincount(records.loc[rows, "label"].to_numpy(), minlength=10).astype(float)

    def entropy(h):
        p = h[h > 0] / h.sum()
        return float(-(p * np.log(p)).sum())

    mean_entropy, corr = {}, {}
    for alpha in (0.1, 1.0, 100.0):
        s = make_split(records, DomainIncrementalSplit(protocol="domain_incremental", clients=5, alpha=alpha, domain_order=("D", "B", "A", "C")), 0)
        tasks = [t for c in s["clients"] for t in c["tasks"]]
        mean_entropy[alpha] = np.mean([entropy(hist(t["train"])) for t in tasks])
        corr[alpha] = np.mean([np.corrcoef(hist(t["train"]), hist(t["test"]))[0, 1] for t in tasks])
    assert mean_entropy[0.1] < mean_entropy[1.0] < mean_entropy[100.0], mean_entropy
    assert mean_entropy[100.0] > 0.9 * np.log(10)  # near uniform
    assert corr[0.1] > 0.7, corr


def _office_like() -> pd.DataFrame:
    """Two domains of 5 classes whose images carry their paths (class folder, then file), as a harmonized benchmark's
    records do; the rows are not in path order."""
    rng = np.random.default_rng(3)
    rows = []
    for dom in ("amazon", "dslr"):
        for c, cls in enumerate(("back_pack", "bike", "mouse", "mouse pad", "mug")):  # ImageFolder: "mouse" first
            for i in range(int(rng.integers(9, 25))):
                rows.append({"domain": dom, "label": c, "group": f"{dom}/{cls}/{i}", "subset": "",
                             "source_path": f"{dom}/{cls}/frame_{i:04d}.jpg"})
    frame = pd.DataFrame(rows).sample(frac=1.0, random_state=1).reset_index(drop=True)
    frame["id"] = [f"x/{i}" for i in range(len(frame))]
    return frame


def test_domain_multi_clients_can_split_and_partition_as_the_f2dc_code_does():
    """``test_select: listing``: in the order torchvision's ImageFolder lists a domain (class folders by name, then
    their files; "mouse" before "mouse pad", which a whole-path string sort would reverse) positions 8 and 9 of every
    ten are the test set, the same for every seed. ``every_class``: each client holds every class of its domain, its
    size kept, a missed class swapped in for one it holds twice or more. A split without either is written as before
    they existed (the same bytes, the same hash)."""
    recs = _office_like()
    p = DomainMultiClientsSplit(protocol="domain_multi_clients", clients_per_domain={"amazon": 2, "dslr": 3}, fraction=0.2,
                                test_from="pooled", test_select="listing", every_class=True)
    s0, s1 = make_split(recs, p, 0), make_split(recs, p, 1)
    for dom in ("amazon", "dslr"):
        sub = recs[recs["domain"] == dom]
        listed = sub.index.to_numpy()[np.lexsort((sub["source_path"].str.split("/").str[-1], sub["label"]))]
        want = sorted(int(r) for r in listed[np.arange(len(listed)) % 10 >= 8])
        for s in (s0, s1):
            cs = [c for c in s["clients"] if c["domain"] == dom]
            assert all(c["test"] == want for c in cs)
            pool = len(listed) - len(want)
            for c in cs:
                assert set(recs.loc[c["train"], "label"]) == set(range(5)), c["name"]
                assert len(c["train"]) == int(0.2 * pool) and not set(c["train"]) & set(want)
    # without every_class a client of this size misses a class somewhere; the seeded test set is another
    plain = make_split(recs, p.model_copy(update={"every_class": False}), 0)
    assert any(set(recs.loc[c["train"], "label"]) != set(range(5)) for c in plain["clients"])
    seeded = make_split(recs, p.model_copy(update={"test_select": "seeded"}), 0)
    assert seeded["clients"][0]["test"] != s0["clients"][0]["test"]
    with pytest.raises(SplitError, match="too few to hold each of the 5 classes"):
        make_split(recs, p.model_copy(update={"fraction": 0.02, "clients_per_domain": {"amazon": 1}}), 0)
    assert "every_class" not in plain["params"] and "test_select" not in seeded["params"]
    assert {"test_select", "every_class"} <= set(s0["params"])
    for bad, why in (({"test_from": "auto"}, "set test_from: pooled"), ({"n_test": 6}, "leave n_test out")):
        with pytest.raises(ValueError, match=why):
            DomainMultiClientsSplit(**{**p.model_dump(), **bad})
    with pytest.raises(ValueError, match="not a multiple of 0.1"):
        DomainMultiClientsSplit(protocol="domain_multi_clients", clients_per_domain={"a": 1}, fraction=0.2, test_select="listing",
                                test_from="pooled", test_fraction=0.25)
    grouped = recs.assign(group=recs["domain"] + "/" + (recs.index // 2).astype(str))
    with pytest.raises(SplitError, match="listing assigns images one by one"):
        make_split(grouped, p, 0)


def test_a_setting_the_file_left_out_at_its_default_is_named_once_the_block_sets_it(records):
    """A split made before n_val existed (or with it at 0) records no n_val: the block asking for a validation set now
    is an edit that train refuses the file for, not a match because the file does not say it."""
    from fedsilo.config import ConfigError
    from fedsilo.data.splits import refuse_stale_split, settings_differ

    p = DomainClientsSplit(n_train=60, n_test=40)
    split = make_split(records, p, 0)
    assert "n_val" not in split["params"]
    assert settings_differ(split, p.model_copy(update={"n_val": 5})) == ["n_val: built with 0, now 5"]
    with pytest.raises(ConfigError, match=r"built with other settings than experiments.e.split has now \(n_val: built with 0, now 5\)"):
        refuse_stale_split(split, p.model_copy(update={"n_val": 5}), "s.json", "e", "dvc repro split@e")


def test_check_patient_disjoint_names_a_patient_on_both_sides_of_a_client(records):
    c0, c1 = records.index[records["group"] == "C/p0"][:2]  # two images of one patient
    split = {"clients": [{"name": "C", "train": [int(c0)], "test": [int(c1)]}]}
    with pytest.raises(SplitError, match=r"client C: patient\(s\) \['C/p0'\] in both train and test"):
        check_patient_disjoint(records, split)
    check_patient_disjoint(records, {"clients": [{"name": "C", "train": [int(c0), int(c1)], "test": []}]})


def test_a_clients_class_of_one_patient_stays_on_its_training_side_whatever_test_fraction():
    """A class a client holds one patient of cannot be split: it trains on it (a test side with a class the client
    never trained on would be scored, at test_fraction 0.6, on nothing it could learn)."""
    from fedsilo.data.splits import _rng, _train_test_by_group

    rows = [{"id": f"r{i}", "domain": "A", "label": 0 if i == 0 else 1, "group": f"g{i}", "subset": ""} for i in range(6)]
    recs = pd.DataFrame(rows)
    train, test = _train_test_by_group(recs, recs.index.to_numpy(), 0.6, _rng(0, "t"))
    assert 0 in train and 0 not in test
    assert len(test) == 3 and set(recs.loc[test, "label"]) == {1}  # round(0.6 x 5) of the other class's patients


def test_domain_incremental_n_per_domain_caps_each_domains_training_pool(records):
    p = DomainIncrementalSplit(protocol="domain_incremental", clients=2, alpha=1.0, n_per_domain=50, min_per_client=1)
    s = make_split(records, p, 0)
    for t in range(4):
        assert sum(len(c["tasks"][t]["train"]) for c in s["clients"]) == 50
    uncapped = make_split(records, p.model_copy(update={"n_per_domain": None}), 0)
    assert all(sum(len(c["tasks"][t]["train"]) for c in uncapped["clients"]) > 250 for t in range(4))
