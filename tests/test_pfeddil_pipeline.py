"""pipelines/pfeddil: both scales validate against the root params and list the runs of Tables 1-3, 6 and Fig. 2; the
paper scale carries Sec. 5.1's configuration; both scales share one dvc.yaml; the published tables name the domains
of the streams in their order."""

from __future__ import annotations

import pytest
import yaml

from fedsilo.config import load_paper_params
from fedsilo.fl.params import load_params
from fedsilo.methods.registry import check_methods, method_base
from tests.conftest import REPO

PAPER = REPO / "pipelines" / "pfeddil"
SCALES = {"quickstart": PAPER / "params.yaml", "paper": PAPER / "paper" / "params.yaml"}
TABLE1 = {"fedavg", "fedprox", "fedcil", "dann", "source_only", "sharing", "disjoint"}


def _load(scale: str):
    root = yaml.safe_load((REPO / "params.yaml").read_text())
    root["pipeline"]["datasets"] = list(root["datasets"])  # the paper scale's datasets added, as the README says
    tmp = REPO / ".pytest_cache" / f"root_params_pfeddil_{scale}.yaml"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_text(yaml.safe_dump(root))
    raw = yaml.safe_load(SCALES[scale].read_text())
    raw["data"] = str(tmp.relative_to(REPO))
    p = load_paper_params(SCALES[scale], raw)
    check_methods(p, str(SCALES[scale]))
    return p


@pytest.mark.parametrize("scale", ["quickstart", "paper"])
def test_scales_validate_and_list_every_row_of_tables_1_to_3(scale):
    p = _load(scale)
    assert p.paper.name == "pfeddil" and p.paper.scale == scale
    for e in ("dil_digits", "dil_office31", "dil_domainnet", "dil_office_caltech", "dil_pacs", "dil_cxr4"):
        ms = set(p.experiment_methods(e))
        assert TABLE1 <= ms, e
        assert p.experiments[e].split.protocol == "domain_incremental"
        lam = 0.5 if e == "dil_digits" else 0.8
        full = [m for m in ms if method_base(m, p.methods[m]) == "pfeddil" and p.methods[m].get("lam") == lam]
        assert len(full) == 4, (e, full)  # pFedDIL and its three ablations at the table's lambda
    lams = sorted(p.methods[m].get("lam") for m in p.experiment_methods("dil_digits") if method_base(m, p.methods[m]) == "pfeddil")
    assert {0.0, 0.2, 0.5, 0.8, 1.0} <= set(lams)  # Table 6
    assert [p.experiments[e].split.alpha for e in ("dil_digits", "dil_digits_a1", "dil_digits_a10")] == [0.1, 1.0, 10.0]


def test_paper_scale_is_section_5_1():
    p = _load("paper")
    for e in p.pipeline.experiments:
        t = p.experiments[e].train
        assert (t.model, t.rounds, t.local_epochs, t.batch_size, t.lr, t.weight_decay, t.client_fraction) == (
            "resnet18", 180, 20, 32, 1e-3, 1e-3, 0.4), e
        assert t.eval_every == 1  # Table 5: rounds to the best accuracy
    clients = {e: p.experiments[e].split.clients for e in ("dil_digits", "dil_office31", "dil_domainnet")}
    assert clients == {"dil_digits": 20, "dil_office31": 10, "dil_domainnet": 20}
    alphas = {e: p.experiments[e].split.alpha for e in ("dil_digits", "dil_office31", "dil_domainnet")}
    assert alphas == {"dil_digits": 0.1, "dil_office31": 1.0, "dil_domainnet": 10.0}
    assert [p.experiments[e].dataset for e in ("dil_digits", "dil_office31", "dil_domainnet")] == [
        "digit10_32", "office31_224", "domainnet10_224"]
    assert list(p.pipeline.seeds) == [0, 1, 2]
    assert p.methods["fedcil"] == {}  # the authors' defaults at paper scale


def test_one_dvc_yaml_and_the_published_tables_follow_the_streams():
    text = (PAPER / "dvc.yaml").read_text()
    assert (PAPER / "paper" / "dvc.yaml").read_text() == text
    stages = {s for s in yaml.safe_load(text)["stages"] if s.startswith("train_")}
    p = load_params(SCALES["quickstart"])
    assert stages == {f"train_{g}" for g in p.paper.runs}
    published = yaml.safe_load((PAPER / "published.yaml").read_text())["accuracy"]
    for scale in SCALES:
        q = _load(scale)
        for e in q.pipeline.experiments:
            ref = q.experiments[e].published
            if not ref:
                continue
            table = published[ref.partition("#")[2]]
            assert list(table["domains"]) == list(q.experiments[e].split.domain_order), (scale, e)
            assert set(table["methods"]) <= set(q.experiment_methods(e)), (scale, e)
