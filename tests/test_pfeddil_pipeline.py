"""pipelines/pfeddil: both scales validate against the root params and list the runs of Tables 1-3, 6 and Fig. 2; the
paper scale carries Sec. 5.1's configuration; both scales share one dvc.yaml; the published tables name the domains
of the streams in their order."""

from __future__ import annotations

import pytest
import yaml

from fedsilo.fl.params import load_params
from fedsilo.methods.registry import method_base
from tests.conftest import REPO, paper_params

PAPER = REPO / "pipelines" / "pfeddil"
SCALES = {"quickstart": PAPER / "params.yaml", "paper": PAPER / "paper" / "params.yaml"}
TABLE1 = {"fedavg", "fedprox", "fedcil", "dann", "source_only", "sharing", "disjoint"}


def _load(scale: str):
    return paper_params("pfeddil", scale)


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


def _fake_run(d, avg, models=None, kept=None):
    """A finished stream run's files as `train` writes them (only the keys the sensitivity report reads)."""
    import json

    d.mkdir(parents=True)
    met = {"accuracy_matrix": [[avg]], "avg_acc": avg, "tasks": ["A"], "rounds_per_task": 1}
    if models is not None:
        met.update(models_per_client=models, bytes_kept_per_client=kept)
    (d / "metrics.json").write_text(json.dumps(met))
    (d / "history.json").write_text("[]")


def test_sensitivity_report_finds_the_lambda_sweeps_and_alpha_families_and_tabulates_them(tmp_path):
    import pandas as pd

    from fedsilo.report.continual import build_sensitivity_report, sensitivity_inputs

    p = _load("quickstart")
    layout = p.layout(tmp_path)
    inp = sensitivity_inputs(p, layout, REPO)
    # Table 6: every full pFedDIL entry by lambda, the ablations left out; Office-31's 0.8 is the Table 2 row
    assert {s: sorted(v) for s, v in inp["lam_runs"].items()} == {
        "digit10": [0.0, 0.2, 0.5, 0.8, 1.0], "office31": [0.0, 0.2, 0.5, 0.8, 1.0], "domainnet": [0.0, 0.2, 0.5, 0.8, 1.0]}
    assert inp["lam_runs"]["digit10"][0.5][1] == "pfeddil" and inp["lam_runs"]["office31"][0.8][1] == "pfeddil_l08"
    assert inp["paper_lambda"]["digit10"]["avg_acc"][2] == 89.28
    # Fig. 2: the three alphas of each dataset, the methods run at all three
    assert {s: sorted(v) for s, v in inp["families"].items()} == {
        "digit10": [0.1, 1.0, 10.0], "office31": [0.1, 1.0, 10.0], "domainnet": [0.1, 1.0, 10.0]}
    assert inp["family_methods"]["office31"] == ["fedavg", "fedprox", "pfeddil_l08", "disjoint"]
    for by_lam in inp["lam_runs"].values():
        for lam, (res, m) in by_lam.items():
            for s in (0, 1):
                _fake_run(res / m / f"seed{s}", 0.5 + lam / 10 + s / 100, models=1 + lam, kept=2**20 * (1 + lam))
    for s_name, fam in inp["families"].items():
        for a, res in fam.items():
            for m in inp["family_methods"][s_name]:
                for s in (0, 1):
                    if not (res / m / f"seed{s}").exists():
                        _fake_run(res / m / f"seed{s}", 0.3 + a / 100 + s / 100)
    out = tmp_path / "sens"
    made = build_sensitivity_report(**inp, seeds=[0, 1], out_dir=out)
    assert made["sensitivity"]["figures"] == ["lambda.png", "alpha.png"]
    lam = pd.read_csv(out / "lambda.csv")
    row = lam[(lam["stream"] == "digit10") & (lam["lambda"] == 1.0)].iloc[0]
    assert row["Avg"] == pytest.approx(100 * (0.6 + 0.005)) and row["Avg_std"] == pytest.approx(100 * 0.01 / 2**0.5, abs=1e-3)  # ddof = 1
    assert row["models_kept"] == 2.0 and row["MiB_kept"] == pytest.approx(2.0) and row["paper_Avg"] == 93.94
    alpha = pd.read_csv(out / "alpha.csv")
    got = alpha[(alpha["stream"] == "office31") & (alpha["method"] == "fedavg")].set_index("alpha")["Avg"]
    assert list(got.index) == [0.1, 1.0, 10.0] and got[10.0] == pytest.approx(100 * (0.3 + 0.1 + 0.005))
    assert "paper Avg" in (out / "lambda.md").read_text() and "alpha 10" in (out / "alpha.md").read_text()


def test_stream_versus_paper_says_both_sides_are_accuracies_at_each_tasks_end():
    from fedsilo.report.versus import load_published, selection_note

    for table in ("digit10", "office31", "domainnet"):
        paper = load_published(REPO, f"pipelines/pfeddil/published.yaml#{table}")
        note = selection_note(paper, "task_end", list(paper["methods"]))
        assert note.count("at that task's end") == 2 and "not recorded" not in note and "final round" not in note, note


def test_stream_cost_table_sets_the_papers_tables_4_and_5_beside_ours():
    import pandas as pd

    from fedsilo.report.continual import cost_markdown

    tab = pd.DataFrame([{"train_s_per_round": 0.5, "rounds_to_best_total": 12.0, "models_per_client": 2.0, "MiB_kept_per_client": 1.0,
                         "MiB_up_per_client_round": 0.1}], index=pd.Index(["pfeddil"], name="method"))
    md = cost_markdown(tab, "t", 10, {"pfeddil": 34.91, "fedavg": 32.14}, {"pfeddil": 379})
    assert "paper s / round (Table 4) | paper rounds to best (Table 5) |" in md and "| 34.91 | 379 |" in md
    assert "paper" not in cost_markdown(tab, "t", 10)


def test_stream_cost_counts_the_rounds_that_upload():
    """Source-only trains and sends nothing after its first task: its seconds and MiB per round are those of the
    rounds it uploads in, not diluted by its idle rounds (0.16 MiB read 0.04 over 40 rounds)."""
    from fedsilo.report.continual import cost_table

    mib = 2**20
    busy = [{"train_seconds": 2.0, "bytes_up_total": 2 * mib, "sampled": ["a", "b"]}] * 10
    idle = [{"train_seconds": 0.0, "bytes_up_total": 0, "sampled": ["a", "b"]}] * 30
    met = {"rounds_to_best_total": 4, "models_per_client": 1.0, "bytes_kept_per_client": mib}
    tab = cost_table({("source_only", 0): met}, {("source_only", 0): busy + idle}, ["source_only"], [0])
    assert tab.loc["source_only", "MiB_up_per_client_round"] == 1.0 and tab.loc["source_only", "train_s_per_round"] == 2.0
    few = [{"train_seconds": 2.0, "bytes_up_total": 4 * mib, "sampled": ["a", "b", "c", "d"]}] * 10  # per taking-part client
    assert cost_table({("m", 0): met}, {("m", 0): few}, ["m"], [0]).loc["m", "MiB_up_per_client_round"] == 1.0


def test_a_stream_of_other_tasks_or_another_order_is_not_set_beside_the_papers_table():
    from fedsilo.report.continual import order_note

    paper = ["MNIST", "EMNIST", "USPS", "SVHN"]
    assert order_note(paper, paper) is None
    assert order_note(paper[::-1], paper).startswith("**Not the paper's task order**: ours SVHN → USPS → EMNIST → MNIST")
    assert order_note(paper[:2], paper).startswith("**Not the paper's stream**: ours MNIST → EMNIST, the paper's MNIST → EMNIST → USPS")
