"""pipelines/cd2pfed and pipelines/fedecouple: their params validate against the root params, list the runs of the
papers' tables (no cross product), carry the papers' optimizers and metrics, and each dvc.yaml has a train stage per
run group."""

from __future__ import annotations

import pytest
import yaml

from fedsilo.fl.params import load_params
from fedsilo.methods.registry import check_methods, method_base
from tests.conftest import REPO, paper_params


def _load(paper: str):
    path = REPO / "pipelines" / paper / "params.yaml"
    p = load_params(path)
    check_methods(p, str(path))
    return p


@pytest.mark.parametrize("paper", ["cd2pfed", "fedecouple"])
def test_dvc_yaml_has_a_train_stage_per_run_group(paper):
    stages = set(yaml.safe_load((REPO / "pipelines" / paper / "dvc.yaml").read_text())["stages"])
    groups = yaml.safe_load((REPO / "pipelines" / paper / "params.yaml").read_text())["runs"]
    assert {f"train_{g}" for g in groups} == {s for s in stages if s.startswith("train_")}
    assert {"split", "report"} <= stages
    # a table across a group's experiments has its stage (the same at paper scale: one dvc.yaml for both files)
    paper_groups = yaml.safe_load((REPO / "pipelines" / paper / "paper" / "params.yaml").read_text())["runs"]
    for gs in (groups, paper_groups):
        assert {f"across_{g}" for g, grp in gs.items() if grp.get("across")} == {s for s in stages if s.startswith("across_")}


def test_cd2pfed_runs_its_tables_with_its_optimizer_and_three_metrics():
    p = _load("cd2pfed")
    assert p.paper.name == "cd2pfed"
    for e in p.experiments:
        t = p.experiments[e].train
        assert (t.model, t.nesterov, t.momentum, t.weight_decay, t.ensemble_test) == ("lenet5", True, 0.9, 5e-4, True)
    assert set(p.experiment_methods("cd2_digits_s2")) >= {"fedavg", "single", "lgfedavg", "fedper", "cd2pfed", "cd2pfed_none", "cd2pfed_ta_cd"}
    assert "cd2pfed_li" not in p.experiment_methods("cd2_digits_s5"), "the ablation runs only where Table 5 is"
    assert [p.experiments[f"cd2_digits_s{s}"].split.classes_per_client for s in (2, 3, 5, 10)] == [2, 3, 5, 10]
    ext = p.experiments["cd2_pacs_external"].split
    assert (ext.protocol, ext.role, ext.holdout) == ("holdout_domain", "external_test", "sketch")
    switches = {m: {k: p.methods[m].get(k, True) for k in ("progressive", "temporal_averaging", "cyclic_distillation")}
                for m in p.experiment_methods("cd2_digits_s2") if method_base(m, p.methods[m]) == "cd2pfed"}
    assert len({tuple(v.values()) for v in switches.values()}) == 8, "Table 5: every on/off combination of LI, TA, CD"


def test_fedecouple_runs_its_baselines_on_each_skew_and_times_table_vii():
    p = _load("fedecouple")
    baselines = {"single", "fedavg_ft", "fedprox", "ditto", "fedper", "lgfedavg", "fedrep", "fedbabu", "fedpac", "fedecouple"}
    schemes = set()
    for e in ("fc_digits_s20", "fc_digits_k3", "fc_digits_dir0_1", "fc_office_dir0_5", "fc_cxr4_dir1"):
        assert baselines <= set(p.experiment_methods(e))
        assert p.experiments[e].split.clients == 20 and p.experiments[e].train.model == "fedecouple_cnn"
        schemes.add(p.experiments[e].split.scheme)
    assert schemes == {"weak_pathological", "pathological", "dirichlet"}
    assert p.experiments["fc_digits_s20"].target_accuracy is not None
    assert method_base("fedavg_ft", p.methods["fedavg_ft"]) == "fedavg" and p.methods["fedavg_ft"]["finetune_epochs"] > 0
    ablation = {m for m in p.experiment_methods("fc_digits_s20") if m.startswith("fedecouple_no_") or m == "fedecouple_none"}
    assert len(ablation) == 5 and "fedecouple_no_da" not in p.experiment_methods("fc_digits_k3")
    # Table IX's sub-settings: without line 24's update, half the anchors, the fixed teacher
    table9 = {k: v for m in p.paper.runs["table9"].methods for k, v in p.methods[m].items() if k not in ("method", "classifier_epochs")}
    assert {k: v for k, v in table9.items() if k not in ("gfa", "glf", "gpc", "da")} == {"global_update": False, "anchor_coverage": 0.5, "teacher": "fixed"}
    for m in p.paper.runs["table9"].methods:  # each sub-setting within its component alone: the three others off
        assert sum(p.methods[m].get(k, True) is False for k in ("gfa", "glf", "gpc", "da")) == 3, m


def _paper_scale(paper: str):
    """The paper-scale preset (both scales share one dvc.yaml)."""
    p = paper_params(paper, "paper")
    assert (REPO / "pipelines" / paper / "paper" / "dvc.yaml").read_text() == (REPO / "pipelines" / paper / "dvc.yaml").read_text()
    return p


def test_cd2pfed_paper_scale_is_section_4_and_sets_the_published_tables_beside_ours():
    p = _paper_scale("cd2pfed")
    c10, c100 = p.experiments["cd2_cifar10_s2"], p.experiments["cd2_cifar100_s40"]
    assert (c10.split.clients, c10.split.classes_per_client, c10.train.model, c10.train.local_epochs) == (10, 2, "lenet5", 1)
    assert (c100.split.clients, c100.split.classes_per_client, c100.train.model, c100.train.local_epochs) == (30, 40, "resnet34", 4)
    # s distinct classes ("s = 10 is an IID setting"), the test side from CIFAR's official test set (5,000 / 1,000 a class)
    for e in [e for e in p.pipeline.experiments if e.startswith(("cd2_cifar10_", "cd2_cifar100_"))]:
        assert (p.experiments[e].split.scheme, p.experiments[e].split.test_from) == ("pathological", "official"), e
    assert all(p.experiments[e].train.rounds == 50 and p.experiments[e].train.batch_size in (128, 4) for e in p.experiments)
    published = yaml.safe_load((REPO / "pipelines" / "cd2pfed" / "published.yaml").read_text())["accuracy"]
    h = p.experiments["cd2_histo_public"]  # HISTO-FED's two public centres: ResNet-32, 4 epochs, batch 4, 7,180 patches each
    assert (h.train.model, h.train.local_epochs, h.train.batch_size, h.split.n_train + h.split.n_test) == ("resnet32", 4, 4, 7180)
    assert published["histo_fed_public"]["domains"] == ["NCT-CRC-HE-100K", "CRC-VAL-HE-7K"]
    for e in ("cd2_cifar10_s2", "cd2_cifar100_s40"):
        table = published[p.experiments[e].published.split("#")[1]]
        assert set(table["domains"]) == {"local", "new"} and set(table["methods"]) <= set(p.experiment_methods(e))


def test_fedecouple_paper_scale_is_section_v_a_and_sets_every_published_table_beside_ours():
    p = _paper_scale("fedecouple")
    published = yaml.safe_load((REPO / "pipelines" / "fedecouple" / "published.yaml").read_text())
    assert p.paper.scale == "paper" and list(p.pipeline.seeds) == [0, 1, 2, 3, 4]  # five runs
    for e in p.pipeline.experiments:
        x = p.experiments[e]
        clients = {"fc_femnist_80": 80, "fc_femnist_100": 100}.get(e, 20)  # Table V: one client per writer
        epochs = int(e.rpartition("_e")[2]) if e.startswith(("fc_cifar10_s20_e", "fc_cinic10_s20_e", "fc_fmnist_s20_e")) else 5
        rounds = 100 if e.startswith("fc_cifar10_dir0_1_n") else 200  # Table VI: 100 rounds
        assert (x.split.clients, x.train.rounds, x.train.local_epochs, x.train.batch_size, x.train.momentum) == (clients, rounds, epochs, 50, 0.5)
        gray = p.datasets[x.dataset].kind in ("fmnist", "emnist", "femnist")
        assert x.train.model == ("fedecouple_cnn_gray" if gray else "fedecouple_cnn")
        assert x.train.lr == (0.01 if gray else 0.02), e  # FedPAC's federated_main.py: 0.02 with the CIFAR CNN
        if getattr(x.split, "scheme", None) == "weak_pathological":  # 600 training and 300 test images per client
            train = {"_n100_": 100, "_n200_": 200}.get(next((k for k in ("_n100_", "_n200_") if k in e), ""), 600)  # Fig. 11
            assert x.split.samples_per_client * (1 - x.split.test_fraction) == pytest.approx(train), e
            assert x.split.samples_per_client * x.split.test_fraction == pytest.approx(300), e
            # FedPAC's code: the 600 from the official training set, the 300 from the official test set (the
            # project's own Digits-Five pools its domains' images)
            assert x.split.test_from == ("pooled" if x.dataset.startswith("digits5") else "official"), e
    # every published accuracy table is some experiment's, whose dataset holds its domain, with the paper's methods run
    refs = {p.experiments[e].published.split("#")[1]: e for e in p.pipeline.experiments if p.experiments[e].published}
    assert set(published["accuracy"]) <= set(refs)
    default_rows = {"fedecouple_lam_0_8", "fedecouple_mu_2_0"}  # lambda 0.8 / mu 2.0 are the fedecouple run itself
    for table, body in published["accuracy"].items():
        e = refs[table]
        assert set(body["methods"]) - default_rows <= set(p.experiment_methods(e)), table
    # Table VII: each timed setting has an experiment whose target is the paper's and which evaluates every round
    for table, body in published["time_to_accuracy"].items():
        x = p.experiments[refs[table]]
        assert x.target_accuracy == body["target"] and x.train.eval_every == 1, table
    assert p.experiments["fc_cinic10_dir0_3"].split.beta == 0.3
    # Table XII: local epochs 1-10 on its three datasets beside Table II's E = 5, E_cl tied to E_fe, the paper's rows
    t12 = p.paper.runs["table12"]
    assert t12.across and t12.published.endswith("#table12") and list(t12.methods) == ["fedecouple"]
    assert p.methods["fedecouple"]["classifier_epochs"] == "local_epochs"
    for e in t12.beside_experiments:
        s20 = p.experiments[e]
        assert {f"{e}_e{k}" for k in (1, 3, 4, 6, 7, 8, 10)} <= set(t12.experiments), e
        for k in (1, 3, 4, 6, 7, 8, 10):  # one setting apart from its E = 5 experiment
            x = p.experiments[f"{e}_e{k}"]
            assert x.split == s20.split and x.train.model_copy(update={"local_epochs": 5}) == s20.train, (e, k)
    assert set(published["across"]["table12"]["methods"]["fedecouple"]) == {p.experiments[e].dataset for e in t12.beside_experiments}
    # Table VI: CIFAR-10 Dirichlet 0.1, every client 200 / 500 / 600 / 1000 training images (and half as many test)
    t6 = p.paper.runs["table6"]
    sized = [p.experiments[e].split for e in t6.experiments]
    assert [round(x.samples_per_client * (1 - x.test_fraction)) for x in sized] == [200, 500, 600, 1000]
    assert all((x.scheme, x.beta, x.test_from) == ("dirichlet", 0.1, "official") for x in sized) and t6.across
    assert set(published["across"]["table6"]["methods"]) == set(t6.methods)
    # Fig. 11: CINIC-10 s = 20 %, 100 or 200 training images a client, rho 0.1 or 0.5, curves every round
    f11 = p.paper.runs["fig11"]
    assert f11.across and {(p.experiments[e].split.samples_per_client, p.experiments[e].train.client_fraction) for e in f11.experiments} == {
        (400, 0.1), (400, 0.5), (500, 0.1), (500, 0.5)}
    assert all(p.experiments[e].dataset == "cinic10_32" and p.experiments[e].train.eval_every == 1 for e in f11.experiments)
    # Table VIII: all 16 on/off combinations of the four components on CIFAR-10 s = 20 %
    combos = {tuple(p.methods[m].get(k, True) for k in ("gfa", "glf", "gpc", "da"))
              for m in p.experiment_methods("fc_cifar10_s20") if method_base(m, p.methods[m]) == "fedecouple"
              and (p.methods[m].get("lam", 0.8), p.methods[m].get("mu", 2.0)) == (0.8, 2.0)}  # not the sweeps
    assert len(combos) == 16
    # the project's own data under label skew, beside the papers' datasets
    kinds = {p.datasets[p.experiments[e].dataset].kind for e in p.pipeline.experiments}
    assert {"digits5", "office_caltech10", "pacs", "chest_xray4", "cifar10", "cifar100", "cinic10", "fmnist", "emnist", "femnist"} <= kinds
    assert {p.experiments[e].split.protocol for e in ("fc_femnist_80", "fc_femnist_100")} == {"by_writer"}
