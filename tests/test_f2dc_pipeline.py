"""pipelines/f2dc: both scales validate against the root params, carry Sec. 5.1's protocol, list the runs of Tables
1-3 and 5-7, share one dvc.yaml, and the published numbers name the domains the splits make."""

from __future__ import annotations

import pytest
import yaml

from fedsilo.data.sources import pacs
from fedsilo.fl.params import load_params
from fedsilo.methods.registry import method_base, resolve_method
from tests.conftest import REPO, paper_params

PAPER = REPO / "pipelines" / "f2dc"
SCALES = {"quickstart": PAPER / "params.yaml", "paper": PAPER / "paper" / "params.yaml"}


def _load(scale: str):
    return paper_params("f2dc", scale)


@pytest.mark.parametrize("scale", ["quickstart", "paper"])
def test_scales_validate_and_list_the_runs_of_each_table(scale):
    p = _load(scale)
    assert p.paper.name == "f2dc" and p.paper.scale == scale
    for e in ("f2dc_digits", "f2dc_office", "f2dc_pacs"):
        assert {"fedavg", "fedprox", "moon", "fedheal", "f2dc"} <= set(p.experiment_methods(e))
        assert p.experiments[e].train.model == "resnet10_cifar"
        assert p.experiments[e].split.protocol == "domain_multi_clients"
    pacs = set(p.experiment_methods("f2dc_pacs"))
    assert {"fedavg_dc", "fedheal_dc", "f2dc_no_dfd", "f2dc_no_dfc", "f2dc_no_daa", "f2dc_feature_plus"} <= pacs
    assert {m for m in pacs if m.startswith("f2dc_sigma_")} == {f"f2dc_sigma_{s}" for s in ("0_01", "0_05", "0_3", "0_5", "1", "5")}
    assert "f2dc_sigma_5" not in p.experiment_methods("f2dc_office")  # Table 5 is PACS only: no cross product
    assert method_base("fedheal_dc", p.methods["fedheal_dc"]) == "fedheal" and "decouple" in p.methods["fedheal_dc"]


def test_paper_scale_is_section_5_1():
    p = _load("paper")
    ours = ["f2dc_digits", "f2dc_office", "f2dc_pacs"]
    assert sorted(p.pipeline.experiments) == sorted(ours)
    clients = {e: dict(p.experiments[e].split.clients_per_domain) for e in ours}
    assert clients == {
        "f2dc_digits": {"MNIST": 3, "USPS": 6, "SVHN": 6, "SynthDigits": 5},
        "f2dc_office": {"caltech": 3, "amazon": 2, "webcam": 2, "dslr": 3},
        "f2dc_pacs": {"photo": 2, "art_painting": 3, "cartoon": 2, "sketch": 3},
    }
    assert [p.experiments[e].split.fraction for e in ours] == [0.01, 0.2, 0.3]
    for e in ours:
        t = p.experiments[e].train
        assert (t.rounds, t.local_epochs, t.lr, t.momentum, t.weight_decay, t.batch_size) == (100, 10, 0.01, 0.9, 1e-5, 64)
        # the authors' code's F²DC: on the same federation, trained with plain SGD at lr 0.1 (its local_optimizer)
        assert "f2dc_code" in p.experiment_methods(e)
        assert resolve_method(p, "f2dc_code", t).train == t.model_copy(update={"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0})
    assert [p.datasets[p.experiments[e].dataset].image_size for e in ours] == [32, 32, 128]
    assert list(p.pipeline.seeds) == [0, 1, 2]
    f = p.methods["f2dc"]
    assert (f["sigma"], f["tau"], f["lambda1"], f["lambda2"], f["alpha"], f["beta"]) == (0.1, 0.06, 0.8, 1.0, 1.0, 0.4)
    assert dict(p.methods["f2dc_code"]) == {"method": "f2dc", "share_modules": True, "domain_aware": False, "convs": 3, "width": 50,
                                            "local_optimizer": {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}}
    assert set(p.paper.runs["authors_code"].beside) == {"fedavg", "f2dc"}


def test_one_dvc_yaml_with_a_train_stage_per_group_and_published_domains_match():
    text = (PAPER / "dvc.yaml").read_text()
    assert (PAPER / "paper" / "dvc.yaml").read_text() == text
    stages = {s for s in yaml.safe_load(text)["stages"] if s.startswith("train_")}
    p = load_params(SCALES["quickstart"])
    assert stages == {f"train_{g}" for g in p.paper.runs}
    published = yaml.safe_load((PAPER / "published.yaml").read_text())["accuracy"]
    for e in p.pipeline.experiments:
        ref = p.experiments[e].published.partition("#")[2]
        table = published[ref]
        assert set(table["domains"]) == set(p.experiments[e].split.clients_per_domain)
        for m, row in table["methods"].items():
            assert len(row["mean"]) in (1, len(table["domains"]) + 1), m
    assert set(published["pacs"]["domains"]) == set(pacs.DOMAINS)
