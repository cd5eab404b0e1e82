"""Issue 16.6: the report's statistics say what they are (sample std, AUC n/a, bytes per participant, standard
errors and test-set sizes, which round each side of the vs-paper table comes from)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest
import yaml

from fedsilo.report import build_report
from fedsilo.report.tables import collect, standard_errors, summary_table, upload_per_participant
from fedsilo.utils.io import read_json, write_json


def _write(root, method, seed, per, *, sampled=None, up=8, sizes=None, history=None, sets=None):
    clients = list(per)
    hist = history or [{"round": r, "bytes_up_total": up * len(sampled or clients), "bytes_down_total": up * len(clients),
                        "sampled": sampled or clients, "bytes_up": {c: up for c in (sampled or clients)},
                        "eval": per, "mean_acc": 0.6, "train_seconds": 1.0} for r in (1, 2)]
    met = {"per_client": per, "clients": clients, "client_domains": {c: c.split("-")[0] for c in clients},
           "bytes_up_per_round": [h["bytes_up_total"] for h in hist], "bytes_down_per_round": [h["bytes_down_total"] for h in hist],
           "model_param_bytes": up, "mean_acc": 0.6, **({"test_sizes": sizes} if sizes else {}),
           **({"test_set_of": sets} if sets else {})}
    write_json(root / method / f"seed{seed}" / "metrics.json", met)
    (root / method / f"seed{seed}" / "history.json").write_text(json.dumps(hist))


def test_std_over_seeds_is_the_sample_std():
    rows = [{"method": "m", "seed": s, "domain": "A", "acc": a} for s, a in enumerate((0.5, 0.6, 0.9))]
    tab = summary_table(pd.DataFrame(rows), "acc", ["m"])
    assert tab["std"].loc["m", "A"] == pytest.approx(np.std([50, 60, 90], ddof=1))
    assert tab["std"].loc["m", "A"] != pytest.approx(np.std([50, 60, 90], ddof=0))


def test_std_over_domains_is_each_runs_sample_std_over_its_domain_columns_and_the_paper_sets_it_beside():
    """F²DC's STD column: FedAvg's Office-Caltech row (59.82, 65.26, 51.72, 46.67) has STD 8.27, the ddof = 1 std over
    the four domains; ours is that per run, then mean ± std over seeds, and the vs-paper table sets it beside."""
    from fedsilo.report.versus import versus_paper

    paper_row = [59.82, 65.26, 51.72, 46.67]
    assert np.std(paper_row, ddof=1) == pytest.approx(8.27, abs=0.01)
    runs = {0: [0.5982, 0.6526, 0.5172, 0.4667], 1: [0.60, 0.70, 0.50, 0.40]}
    rows = [{"method": "fedavg", "seed": s, "domain": d, "acc": a} for s, accs in runs.items() for d, a in zip("ABCD", accs)]
    tab = summary_table(pd.DataFrame(rows), "acc", ["fedavg"], domain_std=True)
    per_run = [np.std(np.array(a) * 100, ddof=1) for a in runs.values()]
    assert list(tab["mean"].columns) == ["A", "B", "C", "D", "Avg", "STD"]
    assert tab["mean"].loc["fedavg", "STD"] == pytest.approx(np.mean(per_run))
    assert tab["std"].loc["fedavg", "STD"] == pytest.approx(np.std(per_run, ddof=1))
    assert "STD" not in summary_table(pd.DataFrame(rows), "acc", ["fedavg"])["mean"].columns
    from fedsilo.report.tables import to_markdown  # the table says what its STD is (the papers' captions do not)

    assert "STD: the sample std (ddof = 1) of a row's accuracies over its domain columns" in to_markdown(tab, "t")
    assert "STD:" not in to_markdown(summary_table(pd.DataFrame(rows), "acc", ["fedavg"]), "t")
    vs = versus_paper(tab, {"domains": list("ABCD"), "methods": {"fedavg": {"mean": paper_row + [55.87], "std_over_domains": 8.27}}})
    assert vs.loc["fedavg", ("STD", "paper")] == 8.27
    assert vs.loc["fedavg", ("STD", "diff")] == pytest.approx(np.mean(per_run) - 8.27)
    # a paper that prints no STD over domains: no STD column beside ours (not a column of "ours / –")
    bare = versus_paper(tab, {"domains": list("ABCD"), "methods": {"fedavg": {"mean": paper_row + [55.87]}}})
    assert "STD" not in {c[0] for c in bare.columns} and bare.loc["fedavg", ("Avg", "paper")] == 55.87


def test_the_table_bolds_the_highest_accuracy_and_the_lowest_std_over_domains():
    """STD is how unevenly a method serves the domains: its best cell is the lowest, the accuracies' the highest."""
    from fedsilo.report.tables import to_markdown

    rows = [{"method": m, "seed": 0, "domain": d, "acc": a} for m, accs in (("even", (0.6, 0.6)), ("uneven", (0.9, 0.5)))
            for d, a in zip("AB", accs)]
    md = to_markdown(summary_table(pd.DataFrame(rows), "acc", ["even", "uneven"], domain_std=True), "t")
    assert "| even | 60.0 | **60.0** | 60.0 | **0.0** |" in md
    assert "| uneven | **90.0** | 50.0 | **70.0** | 28.3 |" in md


def test_a_one_class_test_split_makes_its_auc_and_the_avg_n_a_with_a_warning(tmp_path, caplog):
    res = tmp_path / "res"
    for s in (0, 1):
        _write(res, "fedavg", s, {"A-0": {"acc": 0.8, "auc": 0.9}, "B-0": {"acc": 0.6, "auc": None if s == 1 else 0.7}})
    with caplog.at_level(logging.WARNING, logger="fedsilo.report"):
        build_report(res, "e", ["fedavg"], [0, 1], tmp_path / "out")
    md = (tmp_path / "out" / "e_accuracy.md").read_text()
    auc = md[md.index("test AUC"):]
    row = next(line for line in auc.splitlines() if line.startswith("| fedavg"))
    # A has an AUC in both seeds; B lacks one in seed 1: B and Avg are n/a, not the mean of what is there
    assert row.replace("**", "") == "| fedavg | 90.0 ± 0.0 | n/a | n/a |"
    assert "AUC n/a" in md and "fedavg seed 1 client B-0" in md
    assert any("B-0" in r.getMessage() and "one class" in r.getMessage() for r in caplog.records)
    acc_row = next(line for line in md.splitlines() if line.startswith("| fedavg"))
    assert "n/a" not in acc_row  # accuracy is defined for every client


def test_upload_per_client_divides_by_the_clients_that_took_part():
    hist = [{"round": 1, "bytes_up_total": 300, "sampled": ["a", "b", "c"], "bytes_up": {"a": 100, "b": 100, "c": 100}},
            {"round": 2, "bytes_up_total": 200, "sampled": ["a", "d"], "bytes_up": {"a": 100, "d": 100}},
            {"round": 3, "bytes_up_total": 0, "sampled": [], "bytes_up": {}}]  # a silent round is not averaged in
    assert upload_per_participant(hist) == pytest.approx(100.0)
    assert upload_per_participant([{"round": 1, "bytes_up_total": 0, "sampled": ["a"], "bytes_up": {"a": 0}}]) == 0.0


def test_partial_participation_does_not_shrink_the_communication_table(tmp_path):
    res = tmp_path / "res"
    per = {f"A-{i}": {"acc": 0.5} for i in range(4)}
    _write(res, "fedavg", 0, per, sampled=["A-0", "A-1"], up=64)  # 2 of 4 clients a round, 64 bytes each
    build_report(res, "e", ["fedavg"], [0], tmp_path / "out")
    comm = pd.read_csv(tmp_path / "out" / "e_communication.csv", index_col=0)
    assert comm.loc["fedavg", "upload_MiB"] * 2**20 == pytest.approx(64.0)  # not 2 * 64 / 4


def test_standard_errors_are_binomial_at_the_mean_accuracy_with_the_test_set_size(tmp_path):
    res = tmp_path / "res"
    _write(res, "fedavg", 0, {"A-0": {"acc": 0.8}, "A-1": {"acc": 0.8}, "B-0": {"acc": 0.5}},
           sizes={"A-0": 100, "A-1": 100, "B-0": 25}, sets={"A-0": "A-0", "A-1": "A-0", "B-0": "B-0"})
    df, _ = collect(res, ["fedavg"], [0])
    se = standard_errors(df, summary_table(df, "acc", ["fedavg"]))
    assert se.loc["n", "A"] == 100 and se.loc["n", "B"] == 25  # clients of one domain share its test set
    assert se.loc["fedavg", "A"] == pytest.approx(100 * (0.8 * 0.2 / 100) ** 0.5)  # 4.0 points
    assert se.loc["fedavg", "B"] == pytest.approx(100 * (0.25 / 25) ** 0.5)  # 10.0 points
    assert se.loc["fedavg", "Avg"] == pytest.approx((4.0**2 + 10.0**2) ** 0.5 / 2)
    build_report(res, "e", ["fedavg"], [0], tmp_path / "out")
    md = (tmp_path / "out" / "e_standard_errors.md").read_text()
    assert "| test images n | 100 | 25 | 125 |" in md and "| fedavg | ± 4.0 | ± 10.0 | ± 5.4 |" in md
    assert md in (tmp_path / "out" / "e_accuracy.md").read_text()


def test_a_domain_of_clients_with_their_own_test_sets_counts_every_image_behind_its_column(tmp_path):
    """Label skew on a single-domain dataset: every client of the one domain has its own test set, so the column's
    accuracy (the unweighted mean over clients) rests on all of them, with the variance of a proportion on
    S^2 / sum(1 / n_s) images (F²DC's clients above share one). A run that predates test_set_of says n/a rather
    than guess which."""
    res = tmp_path / "res"
    _write(res, "fedavg", 0, {"A-0": {"acc": 0.8}, "A-1": {"acc": 0.8}}, sizes={"A-0": 10, "A-1": 190},
           sets={"A-0": "A-0", "A-1": "A-1"})
    df, _ = collect(res, ["fedavg"], [0])
    se = standard_errors(df, summary_table(df, "acc", ["fedavg"]))
    exact = 100 * ((0.16 / 10 + 0.16 / 190) ** 0.5) / 2  # the SE of the mean of two proportions, 6.5 points
    assert se.loc["n", "A"] == pytest.approx(4 / (1 / 10 + 1 / 190)) and se.loc["fedavg", "A"] == pytest.approx(exact)
    _write(res, "fedavg", 1, {"A-0": {"acc": 0.8}, "A-1": {"acc": 0.8}}, sizes={"A-0": 50, "A-1": 50},
           sets={"A-0": "A-0", "A-1": "A-1"})
    df, _ = collect(res, ["fedavg"], [1])
    assert standard_errors(df, summary_table(df, "acc", ["fedavg"])).loc["n", "A"] == pytest.approx(100), "equal sets: the total"
    old = tmp_path / "old"
    _write(old, "fedavg", 0, {"A-0": {"acc": 0.7}, "A-1": {"acc": 0.9}}, sizes={"A-0": 40, "A-1": 60})
    df, _ = collect(old, ["fedavg"], [0])
    se = standard_errors(df, summary_table(df, "acc", ["fedavg"]))
    assert se is None or np.isnan(se.loc["n", "A"])


def test_runs_without_test_sizes_get_no_standard_error_table(tmp_path):
    res = tmp_path / "res"
    _write(res, "fedavg", 0, {"A-0": {"acc": 0.8}})
    build_report(res, "e", ["fedavg"], [0], tmp_path / "out")
    assert not (tmp_path / "out" / "e_standard_errors.md").exists()


@pytest.mark.parametrize("selection, says", [
    ("best_validation", "Paper: the test accuracy at the round of best mean validation accuracy."),
    ("final", "Paper: the final round's test accuracy."),
    (None, "Paper: not recorded in the published file."),
])
def test_the_vs_paper_table_says_which_round_each_side_comes_from(tmp_path, selection, says):
    res = tmp_path / "res"
    _write(res, "fedavg", 0, {"A-0": {"acc": 0.8}, "B-0": {"acc": 0.6}})
    table = {"domains": ["A", "B"], "methods": {"fedavg": {"mean": [70.0, 60.0, 65.0]}}}
    if selection:
        table["selection"] = selection
    (tmp_path / "pub.yaml").write_text(yaml.safe_dump({"accuracy": {"t": table}}))
    build_report(res, "e", ["fedavg"], [0], tmp_path / "out", published="pub.yaml#t", repo=tmp_path)
    vs = (tmp_path / "out" / "e_vs_paper.md").read_text()
    assert "Ours: the final round's test accuracy." in vs and says in vs


def test_the_curves_plot_the_tables_avg_over_domains_not_the_mean_over_clients():
    """F²DC's Fig. 5: three clients of domain A at 0.9 and one of B at 0.5 give Avg 0.7 (the table's), not 0.8."""
    from fedsilo.report.tables import domain_avg

    entry = {"eval": {"A-0": {"acc": 0.9}, "A-1": {"acc": 0.9}, "A-2": {"acc": 0.9}, "B-0": {"acc": 0.5}}}
    domain_of = {"A-0": "A", "A-1": "A", "A-2": "A", "B-0": "B"}
    assert domain_avg(entry, domain_of) == pytest.approx(0.7)
    assert domain_avg(entry, {}) == pytest.approx(0.8), "every client its own domain: the mean over clients"


def test_a_domain_of_unknown_test_size_makes_the_avgs_standard_error_n_a_and_sizes_are_not_summed_over_runs(tmp_path):
    """Avg's SE combines every domain's: one without a test-set size (a run that predates test_set_of) leaves it n/a,
    never the SE of the domains that have one; a domain's size is its test set's, not a sum over the runs of a table."""
    res = tmp_path / "res"
    for m in ("fedavg", "fedbn"):
        for s in (0, 1):
            _write(res, m, s, {"A-0": {"acc": 0.8}, "B-0": {"acc": 0.5}}, sizes={"A-0": 100, "B-0": 25})
    df, _ = collect(res, ["fedavg", "fedbn"], [0, 1])
    se = standard_errors(df, summary_table(df, "acc", ["fedavg", "fedbn"]))
    assert se.loc["n", "A"] == 100 and se.loc["n", "B"] == 25 and se.loc["n", "Avg"] == 125
    assert se.loc["fedbn", "A"] == pytest.approx(4.0)
    _write(res, "fedavg", 0, {"A-0": {"acc": 0.8}, "A-1": {"acc": 0.8}, "B-0": {"acc": 0.5}}, sizes={"A-0": 100, "A-1": 100, "B-0": 25},
           sets={"A-0": "A-0", "B-0": "B-0"})
    df, _ = collect(res, ["fedavg"], [0])  # which test set A-1 scored is not recorded: A's size unknown
    se = standard_errors(df, summary_table(df, "acc", ["fedavg"]))
    assert np.isnan(se.loc["n", "A"]) and se.loc["fedavg", "B"] == pytest.approx(10.0)
    assert np.isnan(se.loc["fedavg", "Avg"]) and np.isnan(se.loc["n", "Avg"])  # never the known domains' 25 alone


def test_the_report_names_the_mlflow_run_and_hashes_behind_each_row(tmp_path):
    """Two runs of fedavg seed 0 share the MLflow name `fedavg-seed0`; the report lists the one its numbers come
    from (metrics.json's mlflow_run_id), with its params and code hashes, and says where a run was not tracked."""
    res = tmp_path / "res"
    for m, s in (("fedavg", 0), ("fedavg", 1), ("fedbn", 0), ("fedbn", 1)):
        _write(res, m, s, {"A-0": {"acc": 0.5}})
        met = read_json(res / m / f"seed{s}" / "metrics.json")
        if (m, s) != ("fedbn", 1):
            met.update(mlflow_run_id=f"run{m}{s}", params_hash=f"{m}{s}" * 8, code={"source_sha256": "c0de" * 16},
                       mlflow_experiment="paper/quickstart/e")
        write_json(res / m / f"seed{s}" / "metrics.json", met)
    build_report(res, "e", ["fedavg", "fedbn"], [0, 1], tmp_path / "out")
    runs = pd.read_csv(tmp_path / "out" / "e_runs.csv")
    assert runs[["method", "seed", "mlflow_run_id"]].fillna("").values.tolist() == [
        ["fedavg", 0, "runfedavg0"], ["fedavg", 1, "runfedavg1"], ["fedbn", 0, "runfedbn0"], ["fedbn", 1, ""]]
    assert runs.loc[0, "params_hash"] == "fedavg0" * 8 and runs.loc[0, "code_sha256"] == "c0de" * 16
    md = (tmp_path / "out" / "README.md").read_text()
    assert md.count("e: the runs behind these tables") == 1 and (tmp_path / "out" / "e_runs.md").read_text() in md
    assert "| fedavg | 1 | `runfedavg1` | `fedavg1fedav` | `c0dec0dec0de` |" in md
    assert "| fedbn | 1 | - (not tracked) | - | - |" in md
    assert "MLflow experiment: `paper/quickstart/e`." in md and runs.loc[0, "mlflow_experiment"] == "paper/quickstart/e"


def test_the_first_communication_table_is_up_plus_down_of_all_clients_averaged_over_rounds_and_seeds(tmp_path):
    res = tmp_path / "res"
    mib = 2**20
    for s, up in ((0, mib // 2), (1, mib)):  # 2 clients upload, 4 download: 3 and 6 MiB a round
        _write(res, "fedavg", s, {f"A-{i}": {"acc": 0.5} for i in range(4)}, sampled=["A-0", "A-1"], up=up)
    build_report(res, "e", ["fedavg"], [0, 1], tmp_path / "out")
    acc = (tmp_path / "out" / "e_accuracy.md").read_text()
    assert "| fedavg | 4.50 |" in acc  # (3 + 6) / 2
    comm = pd.read_csv(tmp_path / "out" / "e_communication.csv", index_col=0)
    # Table 3's Ratio: what one taking-part client uploads over the backbone's bytes (here the same), not a round's total
    assert comm.loc["fedavg", "ratio"] == pytest.approx(1.0)


def test_the_onboarding_table_and_fig6_are_the_mean_over_the_seeds_runs(tmp_path, monkeypatch):
    import fedsilo.report.figures as figures

    drawn = {}
    monkeypatch.setattr(figures, "line_figure", lambda path, series, *a, **k: drawn.setdefault(path.name, series) and path.name)
    res = tmp_path / "res"
    _write(res, "pfeddb", 0, {"A-0": {"acc": 0.5}})
    for s, (fg, fa) in enumerate(((0.5, 0.2), (0.7, 0.4))):
        write_json(res / "onboarding" / f"seed{s}" / "onboarding.json",
                   {"newcomer": "N", "rounds": 2, "accuracy_per_round": {"finetune_all": [fa / 2, fa], "freeze_global": [fg / 2, fg]},
                    "final": {"finetune_all": fa, "freeze_global": fg}})
    build_report(res, "e", ["pfeddb"], [0], tmp_path / "out")
    md = (tmp_path / "out" / "e_onboarding.md").read_text()
    assert "mean over 2 seed(s)" in md and "| freeze_global | 60.0 |" in md and "| finetune_all | 30.0 |" in md
    series = drawn["e_fig6_onboarding.png"]
    assert [s for s, *_ in series] == ["freeze_global", "finetune_all"]  # Fig. 6's order
    assert series[0][1] == [1, 2] and series[0][2] == pytest.approx([30.0, 60.0]) and series[1][2] == pytest.approx([15.0, 30.0])


def test_the_runs_table_keeps_each_runs_config_hash_apart_from_its_params_hash(tmp_path):
    """``<experiment>_runs.csv`` holds the full hashes of each run as its metrics.json records them: the config hash
    in its own column, not the params hash again."""
    from fedsilo.report.tables import write_runs_behind

    res = tmp_path / "res"
    _write(res, "fedavg", 0, {"A-0": {"acc": 0.5}})
    met = read_json(res / "fedavg" / "seed0" / "metrics.json")
    write_json(res / "fedavg" / "seed0" / "metrics.json", {**met, "params_hash": "p" * 64, "config_hash": "c" * 64})
    write_runs_behind(res, ["fedavg"], [0], tmp_path, "e")
    runs = pd.read_csv(tmp_path / "e_runs.csv")
    assert runs.loc[0, "params_hash"] == "p" * 64 and runs.loc[0, "config_hash"] == "c" * 64


def test_the_std_over_domains_column_is_no_domain_of_the_standard_error_table(tmp_path):
    """F²DC's tables carry a STD column after Avg (the spread over domains): the standard errors are the domains' and
    Avg's only, and Avg's size and SE combine the domains, not STD as a domain of unknown size."""
    res = tmp_path / "res"
    _write(res, "fedavg", 0, {"A-0": {"acc": 0.8}, "B-0": {"acc": 0.5}}, sizes={"A-0": 100, "B-0": 25})
    df, _ = collect(res, ["fedavg"], [0])
    se = standard_errors(df, summary_table(df, "acc", ["fedavg"], domain_std=True))
    assert list(se.columns) == ["A", "B", "Avg"] and se.loc["n", "Avg"] == 125
    assert se.loc["fedavg", "Avg"] == pytest.approx((4.0**2 + 10.0**2) ** 0.5 / 2)


def test_only_a_binary_tasks_client_without_an_auc_is_named_as_a_one_class_test_split():
    """A client with no AUC because its task has more than two classes (``has_auc`` false) is not a one-class test
    split: only a binary task's client whose AUC is missing is named, with its method, seed and client."""
    from fedsilo.report.tables import one_class_clients

    df = pd.DataFrame([{"method": "fedavg", "seed": 0, "domain": "A", "client": "A-0", "auc": np.nan, "has_auc": True},
                       {"method": "fedavg", "seed": 0, "domain": "B", "client": "B-1", "auc": np.nan, "has_auc": False},
                       {"method": "fedavg", "seed": 1, "domain": "A", "client": "A-0", "auc": 0.7, "has_auc": True}])
    assert one_class_clients(df) == [("fedavg", 0, "A-0")]
