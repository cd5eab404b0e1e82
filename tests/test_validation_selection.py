"""Issue 16.2 (model selection): a split's validation set (n_val), scored every evaluated round, and the report's
test accuracy at the round of best mean validation accuracy (FedBN's protocol) beside the final round's."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from fedsilo.config import DomainClientsSplit, TrainParams
from fedsilo.data.splits import SplitError, make_split
from fedsilo.fl.engine import Engine
from fedsilo.methods import method_class
from fedsilo.report import build_report
from fedsilo.report.tables import collect
from fedsilo.utils.io import write_json
from tests.tiny import style_shifted_federation, tiny_net


def _records(n_per_domain=30, patients=15):
    rows = []
    for d in ("A", "B"):
        for i in range(n_per_domain):
            rows.append({"id": f"{d}{i}", "domain": d, "label": i % 2, "group": f"{d}/p{i % patients}", "subset": ""})
    return pd.DataFrame(rows)


def test_a_validation_set_leaves_train_and_test_as_they_were_and_is_patient_disjoint():
    rec = _records()
    plain = make_split(rec, DomainClientsSplit(n_train=10, n_test=6), seed=0)
    with_val = make_split(rec, DomainClientsSplit(n_train=10, n_test=6, n_val=6), seed=0)
    assert "n_val" not in plain["params"] and all("val" not in c for c in plain["clients"])  # same bytes as before
    for a, b in zip(plain["clients"], with_val["clients"]):
        assert a["train"] == b["train"] and a["test"] == b["test"]
        assert len(b["val"]) == 6
        groups = {k: set(rec.iloc[b[k]]["group"]) for k in ("train", "val", "test")}
        assert not (groups["val"] & groups["train"]) and not (groups["val"] & groups["test"])


def test_too_few_images_for_the_validation_set_names_n_val():
    with pytest.raises(SplitError, match=r"n_val"):
        make_split(_records(), DomainClientsSplit(n_train=10, n_test=6, n_val=20), seed=0)


def test_the_engine_scores_the_validation_set_of_every_client_each_evaluated_round():
    clients = style_shifted_federation(n_train=24, n_test=20, per_domain=1)
    rng = np.random.default_rng(1)
    for c in clients[:2]:  # two clients get a validation set (their own training images' style, other draws)
        pick = rng.choice(len(c.x_train), 8, replace=False)
        c.x_val, c.y_val = c.x_train[pick], c.y_train[pick]
    tp = TrainParams(rounds=2, batch_size=8, lr=0.05, local_epochs=1, device="cpu", count_flops=False)
    cls = method_class("fedavg")
    hist = Engine(cls(cls.params_cls(), tp), tiny_net(1, 4), clients, tp, seed=0).run()
    for e in hist:
        assert set(k for k, v in e["eval"].items() if "val_acc" in v) == {clients[0].name, clients[1].name}
        assert e["mean_val_acc"] == pytest.approx(np.mean([e["eval"][c.name]["val_acc"] for c in clients[:2]]))
    for c in clients:
        c.x_val = c.y_val = None
    assert all("mean_val_acc" not in e for e in Engine(cls(cls.params_cls(), tp), tiny_net(1, 4), clients, tp, seed=0).run())


def _run(root, method, seed, rounds):
    """rounds: [(mean_val_acc, {client: test acc})]"""
    hist = [{"round": r + 1, "bytes_up_total": 8, "bytes_down_total": 8, "sampled": ["A-0", "B-0"], "train_seconds": 1.0,
             "eval": {c: {"acc": a, "val_acc": v} for c, a in acc.items()}, "mean_acc": float(np.mean(list(acc.values()))),
             "mean_val_acc": v} for r, (v, acc) in enumerate(rounds)]
    last = hist[-1]["eval"]
    write_json(root / method / f"seed{seed}" / "metrics.json", {
        "per_client": last, "clients": ["A-0", "B-0"], "client_domains": {"A-0": "A", "B-0": "B"}, "mean_acc": 0.5,
        "bytes_up_per_round": [8] * len(hist), "bytes_down_per_round": [8] * len(hist), "model_param_bytes": 8})
    (root / method / f"seed{seed}" / "history.json").write_text(json.dumps(hist))


def test_best_validation_picks_the_round_of_highest_mean_validation_and_reports_its_test_accuracy(tmp_path):
    res = tmp_path / "res"
    # round 2 has the best validation (0.9, tied by round 4: the first is kept); the final round has the best test
    _run(res, "fedavg", 0, [(0.5, {"A-0": 0.5, "B-0": 0.5}), (0.9, {"A-0": 0.6, "B-0": 0.7}),
                            (0.7, {"A-0": 0.8, "B-0": 0.8}), (0.9, {"A-0": 0.9, "B-0": 0.9})])
    df, _ = collect(res, ["fedavg"], [0])
    picked = df.groupby(["method", "seed"])["best_val_round"].first().to_dict()
    assert picked == {("fedavg", 0): 2}
    assert dict(zip(df["domain"], df["acc_best_val"])) == {"A": 0.6, "B": 0.7}
    table = {"domains": ["A", "B"], "methods": {"fedavg": {"mean": [62.0, 71.0, 66.5]}}, "selection": "best_validation"}
    (tmp_path / "pub.yaml").write_text(yaml.safe_dump({"accuracy": {"t": table}}))
    build_report(res, "e", ["fedavg"], [0], tmp_path / "out", published="pub.yaml#t", repo=tmp_path)
    bv = (tmp_path / "out" / "e_accuracy_best_val.md").read_text()
    assert "| fedavg | 60.0 | 70.0 | 65.0 |" in bv.replace("**", "") and "fedavg seed 0: 2" in bv
    final = (tmp_path / "out" / "e_accuracy.md").read_text()
    assert "| fedavg | 90.0 | 90.0 | 90.0 |" in final.replace("**", "")
    vs = (tmp_path / "out" / "e_vs_paper.md").read_text()  # like for like: the paper selected by validation, so do we
    assert "Ours: the test accuracy at the round of best mean validation accuracy." in vs and "60.0 / 62.0 (-2.0)" in vs


def test_without_a_validation_set_there_is_no_best_validation_table_and_the_comparison_says_final(tmp_path):
    res = tmp_path / "res"
    _run(res, "fedavg", 0, [(0.5, {"A-0": 0.5, "B-0": 0.5})])
    hist = json.loads((res / "fedavg" / "seed0" / "history.json").read_text())
    for e in hist:
        del e["mean_val_acc"]
    (res / "fedavg" / "seed0" / "history.json").write_text(json.dumps(hist))
    table = {"domains": ["A", "B"], "methods": {"fedavg": {"mean": [62.0, 71.0, 66.5]}}, "selection": "best_validation"}
    (tmp_path / "pub.yaml").write_text(yaml.safe_dump({"accuracy": {"t": table}}))
    build_report(res, "e", ["fedavg"], [0], tmp_path / "out", published="pub.yaml#t", repo=tmp_path)
    assert not (tmp_path / "out" / "e_accuracy_best_val.md").exists()
    vs = (tmp_path / "out" / "e_vs_paper.md").read_text()
    assert "Ours: the final round's test accuracy. Paper: the test accuracy at the round of best mean validation accuracy." in vs


def test_rows_selected_differently_by_the_paper_are_each_compared_like_for_like(tmp_path):
    """pFedDB's tables mix scripts: the FedBN-derived baselines report the best-validation round, the two-phase
    pFedDB script its final round. A row's own `selection` overrides the table's; ours follows it row by row, and
    the note says which rule each row uses."""
    res = tmp_path / "res"
    rounds = [(0.9, {"A-0": 0.6, "B-0": 0.7}), (0.5, {"A-0": 0.9, "B-0": 0.9})]  # best validation: round 1
    _run(res, "fedavg", 0, rounds)
    _run(res, "pfeddb", 0, rounds)
    table = {"domains": ["A", "B"], "methods": {"fedavg": {"mean": [62.0, 71.0, 66.5], "selection": "best_validation"},
                                                "pfeddb": {"mean": [88.0, 88.0, 88.0], "selection": "final"},
                                                "fedssd": {"mean": [80.0, 80.0, 80.0]}}}  # a row we do not run
    (tmp_path / "pub.yaml").write_text(yaml.safe_dump({"accuracy": {"t": table}}))
    build_report(res, "e", ["fedavg", "pfeddb"], [0], tmp_path / "out", published="pub.yaml#t", repo=tmp_path)
    vs = (tmp_path / "out" / "e_vs_paper.md").read_text()
    assert "| fedavg | 60.0 / 62.0 (-2.0) |" in vs and "| pfeddb | 90.0 / 88.0 (+2.0) |" in vs
    assert ("fedavg: ours the test accuracy at the round of best mean validation accuracy, paper the test accuracy at the "
            "round of best mean validation accuracy; pfeddb: ours the final round's test accuracy, paper the final round's test accuracy") in vs
    compared, _, unmatched = vs.partition("**The paper's rows with no run here**: ")
    assert "fedssd" not in compared  # the selection note names the rows compared only
    assert unmatched.startswith("fedssd (")  # and the paper's row we do not run is said, below the table


def test_per_client_best_validation_takes_each_clients_own_best_round_for_rows_the_paper_selected_so(tmp_path):
    """The authors' Single scripts run one site at a time and keep each site's best-validation epoch: A's validation
    peaks in round 1, B's in round 3, while the best MEAN validation round is 2."""
    res = tmp_path / "res"
    _run(res, "single", 0, [(0.0, {"A-0": 0.5, "B-0": 0.1}), (0.0, {"A-0": 0.6, "B-0": 0.2}), (0.0, {"A-0": 0.7, "B-0": 0.3})])
    hist = json.loads((res / "single" / "seed0" / "history.json").read_text())
    for e, (va, vb) in zip(hist, [(0.9, 0.1), (0.8, 0.6), (0.1, 0.7)]):
        e["eval"]["A-0"]["val_acc"], e["eval"]["B-0"]["val_acc"] = va, vb
        e["mean_val_acc"] = (va + vb) / 2
    (res / "single" / "seed0" / "history.json").write_text(json.dumps(hist))
    df, _ = collect(res, ["single"], [0])
    assert dict(zip(df["domain"], df["acc_best_own_val"])) == {"A": 0.5, "B": 0.3}
    assert dict(zip(df["domain"], df["acc_best_val"])) == {"A": 0.6, "B": 0.2}, "the mean rule: round 2 for both"
    table = {"domains": ["A", "B"], "methods": {"single": {"mean": [50.0, 30.0, 40.0], "selection": "best_validation_per_client"}}}
    (tmp_path / "pub.yaml").write_text(yaml.safe_dump({"accuracy": {"t": table}}))
    build_report(res, "e", ["single"], [0], tmp_path / "out", published="pub.yaml#t", repo=tmp_path)
    vs = (tmp_path / "out" / "e_vs_paper.md").read_text()
    assert "50.0 / 50.0 (+0.0)" in vs and "30.0 / 30.0 (+0.0)" in vs
    assert "each client's test accuracy at the round of its own best validation accuracy" in vs


def test_a_clients_own_best_validation_round_is_the_first_of_equal_ones():
    from fedsilo.report.tables import own_best_validation_acc

    hist = [{"round": r, "eval": {"A-0": {"acc": a, "val_acc": v}}} for r, (v, a) in enumerate([(0.5, 0.1), (0.8, 0.2), (0.8, 0.9)], 1)]
    assert own_best_validation_acc(hist, "A-0") == 0.2
    assert np.isnan(own_best_validation_acc([{"round": 1, "eval": {"A-0": {"acc": 0.5}}}], "A-0"))


def test_a_rows_own_selection_overrides_the_tables():
    from fedsilo.report.versus import paper_selection

    table = {"selection": "final", "methods": {"fedbn": {"mean": [1.0], "selection": "best_validation"}, "fedavg": {"mean": [1.0]}}}
    assert paper_selection(table, "fedbn") == "best_validation"
    assert paper_selection(table, "fedavg") == "final" and paper_selection(table) == "final"


@pytest.mark.parametrize("scored", [True, False], ids=["validation", "no_validation"])
def test_the_two_phase_figure_plots_validation_accuracy_where_the_split_scored_it(tmp_path, monkeypatch, scored):
    """pFedDB's Fig. 5 plots the average validation accuracy per round: ours does where every run scored a
    validation set, and the test accuracy, said on its axis, where none did."""
    import fedsilo.report.figures as figures

    drawn = {}
    monkeypatch.setattr(figures, "line_figure", lambda path, series, ylabel, *a, **k: drawn.setdefault(path.name, (series, ylabel)) and path.name)
    res = tmp_path / "res"
    rounds = [(0.9, {"A-0": 0.6, "B-0": 0.7}), (0.5, {"A-0": 0.9, "B-0": 0.9})]
    for m in ("single", "fedavg_two_phase", "pfeddb"):
        _run(res, m, 0, rounds)
        if not scored:
            hist = json.loads((res / m / "seed0" / "history.json").read_text())
            for e in hist:  # a split without a validation set: no client scores one
                del e["mean_val_acc"]
                e["eval"] = {c: {"acc": v["acc"]} for c, v in e["eval"].items()}
            (res / m / "seed0" / "history.json").write_text(json.dumps(hist))
    entries = {"single": {}, "fedavg_two_phase": {"method": "fedavg", "local_rounds": 1}, "pfeddb": {}}
    build_report(res, "e", list(entries), [0], tmp_path / "out", method_entries=entries)
    series, ylabel = drawn["e_fig5_two_phase.png"]
    assert ylabel == ("average validation accuracy (%)" if scored else "average test accuracy (%)")
    # the per-domain curves on the validation set beside the test ones (pFedDB's appendix Fig. 2), where scored
    assert ("e_pfeddb_domains_val.png" in drawn) == scored and "e_pfeddb_domains.png" in drawn
    if scored:
        val, ylabel = drawn["e_pfeddb_domains_val.png"]
        assert ylabel == "validation accuracy per domain (%)" and [x[2] for x in val] == [[90.0, 50.0], [90.0, 50.0]]
    assert series[2][2] == pytest.approx([90.0, 50.0] if scored else [65.0, 90.0])


def test_a_best_validation_table_needs_every_run_to_have_scored_a_validation_set(tmp_path):
    res = tmp_path / "res"
    rounds = [(0.9, {"A-0": 0.6, "B-0": 0.7}), (0.5, {"A-0": 0.9, "B-0": 0.9})]
    _run(res, "fedavg", 0, rounds)
    _run(res, "fedbn", 0, rounds)
    build_report(res, "e", ["fedavg", "fedbn"], [0], tmp_path / "out")
    assert "| fedbn | 60.0 | 70.0 | 65.0 |" in (tmp_path / "out" / "e_accuracy_best_val.md").read_text().replace("**", "")
    hist = json.loads((res / "fedbn" / "seed0" / "history.json").read_text())
    for e in hist:  # one run without a validation set: no table of a selection some rows cannot make
        del e["mean_val_acc"]
    (res / "fedbn" / "seed0" / "history.json").write_text(json.dumps(hist))
    build_report(res, "e", ["fedavg", "fedbn"], [0], tmp_path / "out2")
    assert not (tmp_path / "out2" / "e_accuracy_best_val.md").exists()
