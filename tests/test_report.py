"""The report's communication table (pFedDB Fig. 4 / Table 3) comes from the measured payloads."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from fedsilo.config import parse_params
from fedsilo.fl.run import run_training
from fedsilo.models import build_model
from fedsilo.report import build_report
from fedsilo.utils.io import read_json
from tests.conftest import REPO, small_params


def test_communication_table_matches_the_tensors_each_method_uploads(mirror_root, tmp_path):
    root = tmp_path / "proj"
    shutil.copytree(mirror_root / "data", root / "data")
    raw = small_params(rounds=4)
    raw["methods"]["pfeddb"] = {"local_rounds": 2, "cut_depth": 2}
    raw["methods"]["fedavg_two_phase"] = {"method": "fedavg", "local_rounds": 2}
    raw["pipeline"]["methods"] = ["single", "fedavg", "fedavg_two_phase", "pfeddb"]
    raw["experiments"]["quick"]["published"] = "pipelines/pfeddb/published.yaml#chest_xray4"
    p = parse_params(raw)
    import yaml

    from fedsilo.cli import main

    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    assert main(["--root", str(root), "--params", str(tmp_path / "p.yaml"), "split", "--experiment", "quick"]) == 0
    for m in ("single", "fedavg", "fedavg_two_phase", "pfeddb"):
        run_training(p, "quick", m, 0, root)
    shutil.copytree(REPO / "pipelines", root / "pipelines")
    assert main(["--root", str(root), "--params", str(tmp_path / "p.yaml"), "report", "--experiment", "quick"]) == 0
    made = build_report(root / "results" / "quick", "quick", list(raw["pipeline"]["methods"]), [0], root / "results" / "report" / "quick",
                        published=raw["experiments"]["quick"]["published"], method_entries=raw["methods"], repo=root)
    comm = pd.read_csv(root / "results" / "report" / "quick" / "quick_communication.csv", index_col=0)
    model = build_model("simple_cnn", 1, 2, seed=0, width=raw["experiments"]["quick"]["train"]["model_width"])  # the runs' model
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    param_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    assert comm.loc["single", "upload_MiB"] == 0.0
    assert abs(comm.loc["fedavg", "upload_MiB"] * 2**20 - state_bytes) < 1e-6 * state_bytes  # FedAvg uploads the whole state dict
    assert abs(comm.loc["fedavg", "backbone_MiB"] * 2**20 - param_bytes) < 1e-6 * param_bytes
    met = read_json(root / "results" / "quick" / "pfeddb" / "seed0" / "metrics.json")
    per_round = [b for b in met["bytes_up_per_round"] if b > 0]
    # Phase 1 sends nothing until its last round, which uploads the extractors for Eq. 6; then phi every round
    assert met["bytes_up_per_round"][0] == 0 and len(set(per_round)) == 1 and len(per_round) == 3
    assert abs(comm.loc["pfeddb", "upload_MiB"] * 2**20 - per_round[0] / 4) < 1e-6 * per_round[0]
    assert 0 < comm.loc["pfeddb", "saving_vs_fedavg"] < 1
    assert abs(comm.loc["pfeddb", "saving_vs_fedavg"] - (1 - per_round[0] / 4 / state_bytes)) < 1e-6
    md = (root / "results" / "report" / "quick" / "quick_communication.md").read_text()
    assert "| pfeddb |" in md and "saving vs FedAvg" in md
    assert (root / "results" / "report" / "quick" / "quick_communication.png").stat().st_size > 1000
    assert "communication" in made["quick"]
    acc = (root / "results" / "report" / "quick" / "quick_accuracy.md").read_text()
    assert "| method | CheXpert | OpenI | RSNA | VinBigData | Avg |" in acc
    # the runs trained on the offline mirrors: the report's first words say so, above the accuracy table
    readme = (root / "results" / "report" / "quick" / "README.md").read_text()
    assert readme.index("> **Data: offline mirrors** (chexpert: offline mirror (seed ") < readme.index("| method | CheXpert |")
    # ours beside the paper's Table 1, with the difference; a method the table has no row for (the two-phase FedAvg
    # ablation) is there with no paper value ("ours / –")
    vs = pd.read_csv(root / "results" / "report" / "quick" / "quick_vs_paper.csv", index_col=0)
    assert list(vs.index) == ["single", "fedavg", "fedavg_two_phase", "pfeddb"]
    assert pd.isna(vs.loc["fedavg_two_phase", "Avg_paper"]) and not pd.isna(vs.loc["fedavg_two_phase", "Avg_ours"])
    ours = pd.read_csv(root / "results" / "report" / "quick" / "quick_accuracy.csv", index_col=0)
    assert (ours["seeds"] == 1).all(), "the CSV says how many runs each row's mean is over"
    assert abs(vs.loc["pfeddb", "OpenI_paper"] - 73.3) < 1e-9 and abs(vs.loc["single", "Avg_paper"] - 80.7) < 1e-9
    assert abs(vs.loc["fedavg", "RSNA_ours"] - ours.loc["fedavg", "RSNA_mean"]) < 1e-3
    assert abs(vs.loc["fedavg", "RSNA_diff"] - (vs.loc["fedavg", "RSNA_ours"] - 84.1)) < 1e-3
    vs_md = (root / "results" / "report" / "quick" / "quick_vs_paper.md").read_text()
    assert "ours / paper" in vs_md and "The paper's numbers: Table 1; std from appendix Table 2." in vs_md  # its source
    # the quickstart's small CNN beside the paper's DenseNet-121: said above the table
    width = raw["experiments"]["quick"]["train"]["model_width"]
    assert f"**Not the paper's backbone**: ours simple_cnn x{width:g}, the paper's densenet121:" in vs_md
    for fig in ("quick_fig3_scatter.png", "quick_fig5_two_phase.png"):
        assert (root / "results" / "report" / "quick" / fig).stat().st_size > 1000


def test_onboarding_newcomer_strategies_and_fig6(mirror_root, tmp_path):
    """pFedDB Fig. 6 on the mirror: OpenI held out, pFedDB trained on the other three, then the newcomer adapts."""
    import yaml

    from fedsilo.cli import main
    from fedsilo.fl.onboard import STRATEGIES

    root = tmp_path / "proj"
    shutil.copytree(mirror_root / "data", root / "data")
    raw = small_params(rounds=4)
    raw["experiments"]["quick"]["split"] = {"protocol": "holdout_domain", "holdout": "OpenI", "role": "newcomer", "n_train": 24, "n_test": 16}
    raw["experiments"]["quick"]["onboarding"] = {"pretrain_rounds": 2, "rounds": 3}
    raw["methods"]["pfeddb"] = {"local_rounds": 2}
    raw["pipeline"]["methods"] = ["pfeddb"]
    raw["pipeline"]["onboarding"] = ["quick"]
    pfile = tmp_path / "p.yaml"
    pfile.write_text(yaml.safe_dump(raw))
    args = ["--root", str(root), "--params", str(pfile)]
    assert main(args + ["onboard", "--experiment", "quick", "--seed", "0"]) == 2  # no split / no pFedDB model yet
    assert main(args + ["split", "--experiment", "quick"]) == 0
    assert main(args + ["train", "--experiment", "quick", "--method", "pfeddb", "--seed", "0"]) == 0
    met = read_json(root / "results" / "quick" / "pfeddb" / "seed0" / "metrics.json")
    assert sorted(met["per_client"]) == ["CheXpert", "RSNA", "VinBigData"]  # the newcomer took no part
    assert main(args + ["onboard", "--experiment", "quick", "--seed", "0"]) == 0
    out = read_json(root / "results" / "quick" / "onboarding" / "seed0" / "onboarding.json")
    assert out["newcomer"] == "OpenI" and sorted(out["accuracy_per_round"]) == sorted(STRATEGIES)
    assert all(len(c) == 3 and all(0 <= a <= 1 for a in c) for c in out["accuracy_per_round"].values())
    server = __import__("torch").load(root / "results" / "quick" / "pfeddb" / "seed0" / "final_model.pt", weights_only=False)["server"]
    phi = {k: v for k, v in server.items() if k.startswith("shared.")}  # the server's records of the sites aside
    assert phi and out["bytes_down_phi"] == sum(v.numel() * v.element_size() for v in phi.values())
    # tied to the newcomer's arrays and split and to the federation's run, as a run's metrics.json is
    assert out["data"] == met["data"] and out["federation_config_hash"] == met["config_hash"]
    images = root / "data" / "harmonized" / "chest_xray4" / "images.npy"
    kept = images.read_bytes()
    images.write_bytes(kept[:-1] + bytes([kept[-1] ^ 0xFF]))  # one pixel edited after harmonize: refused
    assert main(args + ["onboard", "--experiment", "quick", "--seed", "0"]) == 2
    images.write_bytes(kept)
    assert main(args + ["report", "--experiment", "quick"]) == 0
    rep = root / "results" / "report" / "quick"
    assert (rep / "quick_fig6_onboarding.png").stat().st_size > 1000
    assert "| freeze_global |" in (rep / "quick_onboarding.md").read_text()


def test_freeze_global_never_changes_phi(mirror_root, tmp_path, monkeypatch):
    """The frozen strategy trains psi, fusion and head only: phi's parameters stay exactly the downloaded ones."""
    import torch

    from fedsilo.methods.pfeddb import onboarding as onboard

    seen = {}
    real = onboard.train_local

    def spy(model, client, cfg, gen, params=None, **kw):
        if getattr(model, "phase", 2) == 2 and params is not None and len(params) < len(list(model.parameters())):
            seen["before"] = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("shared.") and "running" not in k and "num_batches" not in k}
            r = real(model, client, cfg, gen, params=params, **kw)
            seen["after"] = {k: v.clone() for k, v in model.state_dict().items() if k in seen["before"]}
            return r
        return real(model, client, cfg, gen, params=params, **kw)

    monkeypatch.setattr(onboard, "train_local", spy)
    test_onboarding_newcomer_strategies_and_fig6(mirror_root, tmp_path)
    assert seen and all(torch.equal(seen["before"][k], seen["after"][k]) for k in seen["before"] if k.endswith(("weight", "bias")))


def test_clients_sharing_a_domain_make_one_column_their_mean(tmp_path):
    import json

    from fedsilo.report.tables import collect, summary_table

    per = {"A-0": 0.5, "A-1": 0.7, "B-0": 0.9}
    for m in ("fedavg", "f2dc"):
        d = tmp_path / m / "seed0"
        d.mkdir(parents=True)
        met = {"per_client": {c: {"acc": a} for c, a in per.items()}, "client_domains": {"A-0": "A", "A-1": "A", "B-0": "B"},
               "bytes_up_per_round": [4], "bytes_down_per_round": [4], "model_param_bytes": 4}
        (d / "metrics.json").write_text(json.dumps(met))
        (d / "history.json").write_text("[]")
    df, _ = collect(tmp_path, ["fedavg", "f2dc"], [0])
    tab = summary_table(df, "acc", ["fedavg", "f2dc"])["mean"]
    assert list(tab.columns) == ["A", "B", "Avg"]
    assert tab.loc["f2dc", "A"] == pytest.approx(60.0) and tab.loc["f2dc", "Avg"] == pytest.approx(75.0)


def test_the_accuracy_table_says_its_avg_is_over_domains_where_domains_hold_several_clients(tmp_path, monkeypatch):
    import json

    import fedsilo.report.figures as report_module
    from fedsilo.report import build_report

    for fig in ("line_figure", "bar_figure"):
        monkeypatch.setattr(report_module, fig, lambda path, *a, **k: path.name)
    accs = {"A-0": 0.5, "A-1": 0.7, "B-0": 0.9}
    d = tmp_path / "res" / "fedavg" / "seed0"
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps({"per_client": {c: {"acc": a} for c, a in accs.items()}, "bytes_up_per_round": [8],
                                                "client_domains": {c: c[0] for c in accs}, "bytes_down_per_round": [8]}))
    (d / "history.json").write_text(json.dumps([{"round": 1, "train_seconds": 1.0, "bytes_up_total": 8, "bytes_down_total": 8,
                                                 "sampled": list(accs), "eval": {c: {"acc": a} for c, a in accs.items()}}]))
    build_report(tmp_path / "res", "e", ["fedavg"], [0], tmp_path / "out")
    md = (tmp_path / "out" / "README.md").read_text()
    assert "| fedavg | **60.0** | **90.0** | **75.0** |" in md  # Avg 75: the domains' mean, where the clients' is 70
    assert "Avg: the mean over the domain columns, each the mean over its clients" in md


def test_collapse_table_fig1_and_flops_column_from_the_run_files(tmp_path):
    import json

    from fedsilo.report import build_report

    spectra = {"fedavg": [4.0, 1e-6, 1e-7, 1e-8], "f2dc": [1.0, 1.0, 1.0, 1.0]}  # collapsed vs flat
    for m in ("fedavg", "f2dc"):
        d = tmp_path / "res" / m / "seed0"
        d.mkdir(parents=True)
        hist = [{"round": 1, "train_seconds": 2.0, "bytes_up_total": 8, "bytes_down_total": 8, "sampled": ["A-0"],
                 "eval": {"A-0": {"acc": 0.5}}, "mean_acc": 0.5},
                {"round": 2, "train_seconds": 9.0, "train_flops": 3e9, "bytes_up_total": 8, "bytes_down_total": 8, "sampled": ["A-0"],
                 "eval": {"A-0": {"acc": 0.6}}, "mean_acc": 0.6}]
        met = {"per_client": {"A-0": {"acc": 0.6}}, "client_domains": {"A-0": "A"}, "bytes_up_per_round": [8, 8],
               "bytes_down_per_round": [8, 8], "model_param_bytes": 8, "train_flops_per_round": 3e9}
        (d / "metrics.json").write_text(json.dumps(met))
        (d / "history.json").write_text(json.dumps(hist))
        (d / "spectrum.json").write_text(json.dumps({"clients": {"A-0": spectra[m]}}))
    made = build_report(tmp_path / "res", "e", ["fedavg", "f2dc"], [0], tmp_path / "out")
    assert "e_fig1_spectrum.png" in made["e"]["figures"] and (tmp_path / "out" / "e_fig1_spectrum.png").stat().st_size > 0
    col = pd.read_csv(tmp_path / "out" / "e_collapse.csv", index_col="method")
    assert col.loc["f2dc", "effective_rank"] == pytest.approx(4.0) and col.loc["fedavg", "effective_rank"] < 1.01
    comm = made["e"]["communication"]["fedavg"]
    assert comm["train_GFLOPs_per_round"] == pytest.approx(3.0)
    assert comm["train_s_per_round"] == pytest.approx(2.0)  # the counted round's time is left out
    (tmp_path / "res" / "f2dc" / "seed0" / "spectrum.json").unlink()  # an older run: no collapse table, said so
    made = build_report(tmp_path / "res", "e", ["fedavg", "f2dc"], [0], tmp_path / "out2")
    assert not (tmp_path / "out2" / "e_collapse.md").exists()
    assert "predate `spectrum.json`" in (tmp_path / "out2" / "README.md").read_text()


def test_collapse_table_is_the_mean_and_sample_std_over_seeds_of_the_mean_over_clients():
    from fedsilo.report.tables import collapse_table

    spectra = {("m", 0): {"A-0": [1.0, 1.0, 1.0, 1.0], "B-0": [1.0, 1.0], "C-0": []},  # C-0: too few images, left out
               ("m", 1): {"A-0": [1.0, 1.0], "B-0": [1.0, 1.0]}}
    tab = collapse_table(spectra, ["m"], [0, 1])
    assert tab.loc["m", "dim"] == 4 and tab.loc["m", "effective_rank"] == pytest.approx((3.0 + 2.0) / 2)
    assert tab.loc["m", "effective_rank_std"] == pytest.approx(np.std([3.0, 2.0], ddof=1))
    assert np.isnan(collapse_table(spectra, ["m"], [0]).loc["m", "effective_rank_std"])  # one seed has no spread


def test_time_to_accuracy_counts_rounds_seconds_and_bytes_until_the_first_crossing():
    from fedsilo.report.tables import time_to_accuracy

    def hist(accs):
        return [{"round": r + 1, "train_seconds": 2.0, "bytes_up_total": 2**20, "bytes_down_total": 2**20,
                 "eval": {"a": {}, "b": {}}, "mean_acc": a} for r, a in enumerate(accs)]

    h = {("fast", 0): hist([0.5, 0.8, 0.6, 0.9]), ("fast", 1): hist([0.7, 0.75, 0.9, 0.9]), ("slow", 0): hist([0.1, 0.2, 0.3, 0.4]),
         ("slow", 1): hist([0.1, 0.2, 0.3, 0.75])}
    tab = time_to_accuracy(h, ["fast", "slow"], [0, 1], 75.0)
    assert tab.loc["fast", "round"] == pytest.approx(2.0) and tab.loc["fast", "reached"] == "2/2"
    assert tab.loc["fast", "train_s"] == pytest.approx(4.0) and tab.loc["fast", "MiB_per_client"] == pytest.approx(2.0)
    assert tab.loc["slow", "reached"] == "1/2" and tab.loc["slow", "round"] == pytest.approx(4.0)


def _timed_runs(res, accs: dict[str, list[float]], up_bytes: int):
    """Runs of one client whose histories reach the given mean accuracies, 60 s of training and ``up_bytes`` up and
    down each round."""
    import json

    for m, curve in accs.items():
        d = res / m / "seed0"
        d.mkdir(parents=True)
        hist = [{"round": r + 1, "train_seconds": 60.0, "bytes_up_total": up_bytes, "bytes_down_total": up_bytes, "sampled": ["A-0"],
                 "eval": {"A-0": {"acc": a}}, "mean_acc": a} for r, a in enumerate(curve)]
        met = {"per_client": {"A-0": {"acc": curve[-1]}}, "client_domains": {"A-0": "A"}, "bytes_up_per_round": [up_bytes] * len(curve),
               "bytes_down_per_round": [up_bytes] * len(curve), "model_param_bytes": up_bytes}
        (d / "metrics.json").write_text(json.dumps(met))
        (d / "history.json").write_text(json.dumps(hist))


def test_time_to_accuracy_sets_the_papers_table_vii_beside_ours(tmp_path):
    """FedeCouple Table VII: a published time_to_accuracy entry under the experiment's published key is set beside
    our rounds, MB (the paper's 1,024,000-byte MB) and minutes; its target must be the experiment's; a key with only
    a time_to_accuracy entry (CINIC-10 beta 0.3) needs no accuracy table."""
    import yaml

    from fedsilo.report import ReportError, build_report

    _timed_runs(tmp_path / "res", {"fedecouple": [0.5, 0.7, 0.9], "fedrep": [0.4, 0.5, 0.6]}, up_bytes=512_000)
    (tmp_path / "pub.yaml").write_text(yaml.safe_dump({"time_to_accuracy": {"t": {"target": 70, "methods": {
        "fedecouple": {"minutes": 3.0, "rounds": 3, "comm_MB": 3.0}, "fedrep": {"minutes": 9.0, "rounds": 9, "comm_MB": 9.0},
        "fedpac": {"minutes": 5.0, "rounds": 5, "comm_MB": 5.0}}}}}, sort_keys=False))
    build_report(tmp_path / "res", "e", ["fedecouple", "fedrep"], [0], tmp_path / "out", published="pub.yaml#t", repo=tmp_path,
                 target_accuracy=70)
    vs = pd.read_csv(tmp_path / "out" / "e_time_to_accuracy_vs_paper.csv", index_col="method")
    assert list(vs.index) == ["fedecouple", "fedrep", "fedpac"]  # the paper's rows, in its order
    assert vs.loc["fedecouple", "rounds_ours"] == 2 and vs.loc["fedecouple", "rounds_paper"] == 3
    assert vs.loc["fedecouple", "MB_ours"] == pytest.approx(2.0)  # 2 rounds x (512,000 up + 512,000 down) / 1,024,000
    assert vs.loc["fedecouple", "minutes_ours"] == pytest.approx(2.0)
    assert pd.isna(vs.loc["fedrep", "rounds_ours"]) and vs.loc["fedrep", "reached"] == "0/1"
    assert vs.loc["fedpac", "reached"] == "not run"
    md = (tmp_path / "out" / "e_time_to_accuracy_vs_paper.md").read_text()
    assert "| fedecouple | 1/1 | 2.0 / 3.0 | 2.0 / 3.0 | 2.0 / 3.0 |" in md and "| fedrep | 0/1 | — / 9.0 |" in md
    assert not (tmp_path / "out" / "e_vs_paper.md").exists()  # no accuracy table under that key
    with pytest.raises(ReportError, match=r"experiments\.e\.target_accuracy: 65 but pub\.yaml#t's time_to_accuracy target is 70"):
        build_report(tmp_path / "res", "e", ["fedecouple"], [0], tmp_path / "out2", published="pub.yaml#t", repo=tmp_path, target_accuracy=65)
    assert not (tmp_path / "out2").exists()  # nothing half-written


def test_local_new_external_table_averages_each_column_over_seeds(tmp_path):
    from fedsilo.report.tables import local_new_external, local_new_external_markdown
    from fedsilo.utils.io import write_json

    values = {("cd2pfed", 0): (0.9, 0.6), ("cd2pfed", 1): (0.8, 0.5), ("fedavg", 0): (0.5, 0.55), ("fedavg", 1): (0.5, 0.45)}
    for (m, s), (local, new) in values.items():
        write_json(tmp_path / m / f"seed{s}" / "metrics.json", {"mean_acc": local, "ensemble_acc": new})
    tab = local_new_external(tmp_path, ["cd2pfed", "fedavg"], [0, 1])
    assert list(tab["mean"].columns) == ["local test", "new test"], "no external site: no external column"
    sd = 10 / 2**0.5  # the sample std (ddof = 1) of two values 10 points apart
    assert tab["mean"].loc["cd2pfed", "local test"] == pytest.approx(85.0) and tab["std"].loc["cd2pfed", "new test"] == pytest.approx(sd)
    assert tab["mean"].loc["fedavg", "new test"] == pytest.approx(50.0)
    assert f"| cd2pfed | 85.00 ± {sd:.2f} | 55.00 ± {sd:.2f} |" in local_new_external_markdown(tab, "t")
    # a paper's local / new table (CD2-pFed's) is set beside these columns, without an Avg
    import pandas as pd

    from fedsilo.report.tables import METRIC_COLUMNS_INV
    from fedsilo.report.versus import versus_paper

    paper = {"domains": ["local", "new"], "methods": {"cd2pfed": {"mean": [91.82, 61.31]}, "fedper": {"mean": [83.29, 57.77]}}}
    vs = versus_paper(pd.concat({"mean": tab["mean"].rename(columns=METRIC_COLUMNS_INV)}, axis=1), paper, avg=False)
    assert list(vs.index) == ["cd2pfed", "fedavg"] and vs.loc["cd2pfed", ("local", "diff")] == pytest.approx(85.0 - 91.82)
    assert pd.isna(vs.loc["fedavg", ("local", "paper")])  # the paper's table has no FedAvg row: "ours / –"
    assert vs.loc["cd2pfed", ("new", "paper")] == 61.31 and "Avg" not in {c[0] for c in vs.columns}
    for (m, s) in values:
        write_json(tmp_path / m / f"seed{s}" / "metrics.json", {"mean_acc": 0.5})
    assert local_new_external(tmp_path, ["cd2pfed", "fedavg"], [0, 1]) is None, "runs without an ensemble: no table"
    # the images each column scores (the distinct test sets; the held-out site's) and their standard error; a tie said
    for (m, s) in values:
        write_json(tmp_path / m / f"seed{s}" / "metrics.json", {
            "mean_acc": 0.5, "ensemble_acc": 0.5, "external_ensemble_acc": 0.25, "external_test_size": 84,
            "test_sizes": {"a": 30, "b": 30, "c": 40}, "test_set_of": {"a": "a", "b": "a", "c": "c"}})
    md = local_new_external_markdown(local_new_external(tmp_path, ["cd2pfed", "fedavg"], [0, 1]), "t")
    assert "new test: 70 images (standard error near 50 %: ±6.0 points); external test: 84 images (standard error near 50 %: ±5.5 points)." in md
    assert "> **Note:** all 2 methods scored the same in every column" in md


def test_per_domain_figure_draws_a_line_per_domain_the_mean_of_its_clients(tmp_path, monkeypatch):
    import fedsilo.report.figures as report

    drawn: dict[str, list] = {}
    monkeypatch.setattr(report, "line_figure", lambda path, series, *a: drawn.__setitem__(path.name, series) or path.name)
    hist = [{"round": r, "bytes_up_total": 0, "bytes_down_total": 0,
             "eval": {"a1": {"acc": 0.2 * r}, "a2": {"acc": 0.4 * r}, "b1": {"acc": 0.1 * r}}} for r in (1, 2)]
    report.round_figures(tmp_path, "x", ["fedavg"], [0], {("fedavg", 0): hist}, {"a1": "A", "a2": "A", "b1": "B"})
    series = {name: ys for name, _, ys in drawn["x_fedavg_domains.png"]}
    assert set(series) == {"A", "B"}
    assert series["A"] == pytest.approx([30.0, 60.0]) and series["B"] == pytest.approx([10.0, 20.0])
    # clients of one dataset (label skew): no per-domain figure (its one line is the curve), the curve says clients
    drawn.clear()
    monkeypatch.setattr(report, "line_figure", lambda path, series, ylabel, *a: drawn.__setitem__(path.name, ylabel) or path.name)
    report.round_figures(tmp_path, "x", ["fedavg"], [0], {("fedavg", 0): hist}, {"a1": "A", "a2": "A", "b1": "A"})
    assert set(drawn) == {"x_curves.png", "x_bytes.png"} and drawn["x_curves.png"] == "mean test accuracy over clients (%)"


def test_the_curves_are_the_tables_avg_per_round_over_the_seeds_that_evaluated_it_and_bytes_are_up_plus_down(tmp_path, monkeypatch):
    """The curves figure plots, per round every seed evaluated (matched by round number: a round one seed did not
    score is left out), the mean over seeds of the Avg over domains (each the mean of its clients, as the table forms
    it); the bytes figure each round's upload plus download in MiB; the validation curves only where every client
    scored a validation set."""
    import fedsilo.report.figures as report

    drawn: dict[str, list] = {}
    monkeypatch.setattr(report, "line_figure", lambda path, series, *a: drawn.__setitem__(path.name, series) or path.name)

    def entry(r, a1, a2, b1, val=True):
        ev = {"a1": {"acc": a1}, "a2": {"acc": a2}, "b1": {"acc": b1}}
        if val:
            for c in ev:
                ev[c]["val_acc"] = 0.5
        return {"round": r, "bytes_up_total": 3 * 2**20, "bytes_down_total": 2**20, "eval": ev}

    hist = {("fedavg", 0): [entry(1, 0.2, 0.4, 0.1), entry(2, 0.4, 0.8, 0.2), entry(3, 0.5, 0.5, 0.5)],
            ("fedavg", 1): [entry(1, 0.4, 0.6, 0.3), {"round": 2, "bytes_up_total": 0, "bytes_down_total": 0},
                            entry(3, 0.7, 0.7, 0.7, val=False)]}
    report.round_figures(tmp_path, "x", ["fedavg"], [0, 1], hist, {"a1": "A", "a2": "A", "b1": "B"})
    (name, rounds, ys), = drawn["x_curves.png"]
    # seed 0: round 1 Avg (30 + 10) / 2 = 20, seed 1: (50 + 30) / 2 = 40; round 2 not scored by seed 1: left out
    assert name == "fedavg" and rounds == [1, 3] and ys == pytest.approx([30.0, 60.0])
    (name, rounds, mib), = drawn["x_bytes.png"]
    assert rounds == [1, 2, 3] and mib == pytest.approx([4.0, 4.0, 4.0])  # seed 0's rounds, 3 MiB up + 1 MiB down
    assert "x_fedavg_domains_val.png" not in drawn  # seed 1's third round scored no validation set


def _spy_on_axes(monkeypatch, seen: dict[str, list]) -> None:
    """Each matplotlib Axes method named in ``seen`` records its (args, kwargs) there, then draws as it would."""
    from matplotlib.axes import Axes

    for name in seen:
        real = getattr(Axes, name)

        def spy(self, *a, _real=real, _name=name, **k):
            seen[_name].append((a, k))
            return _real(self, *a, **k)

        monkeypatch.setattr(Axes, name, spy)


def test_the_spectrum_and_scatter_figures_plot_the_mean_over_seeds_and_the_pairs_of_domains(tmp_path, monkeypatch):
    """F²DC's Fig. 1: a bar per singular value at log10 of its mean over seeds' logs (bars from the smallest up);
    pFedDB's Fig. 3: each method at the mean of CheXpert and RSNA (x) and of OpenI and VinBigData (y), the paper's
    point beside it where its table has the method."""

    from fedsilo.report.figures import fig1_spectrum, fig3_scatter

    seen: dict[str, list] = {"bar": [], "scatter": []}
    _spy_on_axes(monkeypatch, seen)
    spectra = {("fedavg", 0): {"A-0": [100.0, 10.0, 1.0]}, ("fedavg", 1): {"A-0": [10000.0, 1.0, 0.01]}}
    fig1_spectrum(tmp_path / "f1.png", spectra, ["fedavg"], [0, 1], "A-0", "t")
    (x, heights), k = seen["bar"][0]
    assert list(x) == [0, 1, 2] and k["bottom"] == pytest.approx(-1.0)
    assert list(np.asarray(heights) + k["bottom"]) == pytest.approx([3.0, 0.5, -1.0])  # log10 means: (2 + 4) / 2, ...
    cols = ["CheXpert", "OpenI", "RSNA", "VinBigData"]
    acc = pd.concat({"mean": pd.DataFrame([[80.0, 60.0, 70.0, 50.0]], index=["fedavg"], columns=cols)}, axis=1)
    paper = {"domains": cols, "methods": {"fedavg": {"mean": [90.0, 70.0, 80.0, 60.0, 75.0]}}}
    fig3_scatter(tmp_path / "f3.png", acc, paper, "t")
    (ours, paper_point) = [a for a, _ in seen["scatter"]]
    assert ours == ([75.0], [55.0]) and paper_point == ([85.0], [65.0])


def test_the_upload_figure_draws_a_bar_per_method_in_the_reports_order_at_its_measured_upload(tmp_path, monkeypatch):
    """The communication figure hands matplotlib one bar per method, in the report's order (not sorted), each at the
    MiB it uploaded per client per round: the communication table's numbers."""
    seen: dict[str, list] = {"bar": []}
    _spy_on_axes(monkeypatch, seen)
    _timed_runs(tmp_path / "res", {"fedrep": [0.5]}, up_bytes=3 * 2**20)
    _timed_runs(tmp_path / "res", {"fedavg": [0.5]}, up_bytes=2**20)
    build_report(tmp_path / "res", "e", ["fedrep", "fedavg"], [0], tmp_path / "out")
    (labels, values), _ = next(call for call in seen["bar"] if list(call[0][0]) == ["fedrep", "fedavg"])
    assert list(values) == pytest.approx([3.0, 1.0])


def test_the_scatter_marks_singles_pair_means_and_gives_a_method_the_paper_lacks_no_paper_point(tmp_path, monkeypatch):
    """pFedDB's Fig. 3: Single's dashed lines stand at its mean of CheXpert and RSNA (x) and of OpenI and VinBigData
    (y); a method the published table has no row for is drawn with its own point only."""
    from fedsilo.report.figures import fig3_scatter

    seen: dict[str, list] = {"scatter": [], "axvline": [], "axhline": []}
    _spy_on_axes(monkeypatch, seen)
    cols = ["CheXpert", "OpenI", "RSNA", "VinBigData"]
    acc = pd.concat({"mean": pd.DataFrame([[80.0, 60.0, 70.0, 50.0], [70.0, 40.0, 60.0, 30.0]], index=["fedavg", "single"],
                                          columns=cols)}, axis=1)
    paper = {"domains": cols, "methods": {"fedavg": {"mean": [90.0, 70.0, 80.0, 60.0, 75.0]}}}
    fig3_scatter(tmp_path / "f3.png", acc, paper, "t")
    assert [a for a, _ in seen["scatter"]] == [([75.0], [55.0]), ([85.0], [65.0]), ([65.0], [35.0])]
    assert seen["axvline"][0][0] == (65.0,) and seen["axhline"][0][0] == (35.0,)


def test_versus_paper_warns_when_our_avg_covers_domains_the_paper_has_not(caplog):
    import logging

    from fedsilo.report.versus import versus_paper

    acc = pd.concat({"mean": pd.DataFrame({"A": [50.0], "B": [70.0], "C": [90.0], "Avg": [70.0]}, index=["fedavg"]),
                     "std": pd.DataFrame({"A": [0.0], "B": [0.0], "C": [0.0], "Avg": [0.0]}, index=["fedavg"])}, axis=1)
    same = {"domains": ["A", "B", "C"], "methods": {"fedavg": {"mean": [50, 70, 90, 70]}}}
    with caplog.at_level(logging.WARNING, logger="fedsilo.report"):
        versus_paper(acc, same)
    assert not caplog.records
    fewer = {"domains": ["A", "B"], "methods": {"fedavg": {"mean": [50, 70, 60]}}}
    with caplog.at_level(logging.WARNING, logger="fedsilo.report"):
        tab = versus_paper(acc, fewer)
    assert "no column for C" in caplog.text and tab[("Avg", "diff")].iloc[0] == pytest.approx(10.0)


def test_an_avg_only_paper_row_stands_under_avg_and_leaves_the_domain_columns_without_a_paper_value():
    """A sensitivity table that prints only the mean over domains (one value a row) is compared under Avg alone: its
    one value is the paper's Avg, not its first domain's; a full row beside it fills every column."""
    from fedsilo.report.versus import versus_markdown, versus_paper

    cols = ["A", "B", "Avg"]
    acc = pd.concat({"mean": pd.DataFrame([[50.0, 70.0, 60.0], [40.0, 80.0, 60.0]], index=["fedavg", "f2dc"], columns=cols),
                     "std": pd.DataFrame(0.0, index=["fedavg", "f2dc"], columns=cols)}, axis=1)
    tab = versus_paper(acc, {"domains": ["A", "B"], "methods": {"fedavg": {"mean": [55.0]}, "f2dc": {"mean": [45.0, 75.0, 60.0]}}})
    assert tab.loc["fedavg", ("Avg", "paper")] == 55.0 and tab.loc["fedavg", ("Avg", "diff")] == pytest.approx(5.0)
    assert pd.isna(tab.loc["fedavg", ("A", "paper")]) and pd.isna(tab.loc["fedavg", ("B", "paper")])
    assert [tab.loc["f2dc", (d, "paper")] for d in cols] == [45.0, 75.0, 60.0]
    assert "| fedavg | 50.0 / – | 70.0 / – | 60.0 / 55.0 (+5.0) |" in versus_markdown(tab, "t")


def test_one_table_of_a_paper_is_reported_from_its_groups_runs_and_names_the_runs_it_lacks(tmp_path, capsys, monkeypatch):
    """`fedsilo report --group table4`: the group's runs and the full method it sets beside (runs.<g>.beside), written
    apart from the report stages' outputs; before they exist, every missing run and the `dvc repro` targets that
    train exactly those (the group's own stage and the other group's). The tables only: the figures are drawn (and
    checked) by the tests above, here each is a name."""
    import json

    import fedsilo.report.figures as report_module
    from fedsilo.cli import main
    from tests.conftest import REPO

    for fig in ("line_figure", "bar_figure", "fig3_scatter"):
        monkeypatch.setattr(report_module, fig, lambda path, *a, **k: path.name)

    (tmp_path / "pipelines").symlink_to(REPO / "pipelines")  # the published numbers the report reads
    params = ["--params", str(REPO / "pipelines" / "pfeddb" / "params.yaml"), "--root", str(tmp_path)]
    capsys.readouterr()
    assert main([*params, "report", "--group", "table4", "--experiment", "pfeddb_cxr4"]) == 2
    err = capsys.readouterr().err
    assert ("runs.table4: 2 run(s) not trained yet (pfeddb_cxr4/pfeddb_one_phase/seed0, pfeddb_cxr4/pfeddb/seed0); train them: "
            "dvc repro pipelines/pfeddb/dvc.yaml:train_table4@pfeddb_cxr4-pfeddb_one_phase-0 "
            "pipelines/pfeddb/dvc.yaml:train_tables_1_2@pfeddb_cxr4-pfeddb-0 (or several at once: fedsilo --params "
            f"{REPO / 'pipelines' / 'pfeddb' / 'params.yaml'} grid --jobs 2, every out-of-date run of the pipeline)") in err, err
    # the whole experiment's report and pFedDIL's sensitivity figures name their missing runs' targets the same way
    assert main([*params, "report", "--experiment", "pfeddb_cxr4"]) == 2
    assert "report: " in (err := capsys.readouterr().err) and "dvc repro pipelines/pfeddb/dvc.yaml:train_" in err, err
    stream = ["--params", str(REPO / "pipelines" / "pfeddil" / "params.yaml"), "--root", str(tmp_path)]
    assert main([*stream, "report", "--sensitivity"]) == 2
    err = capsys.readouterr().err
    assert "--sensitivity: " in err and "dvc repro pipelines/pfeddil/dvc.yaml:train_" in err, err
    assert " pipelines/pfeddil/dvc.yaml:train_table6@dil_digits-pfeddil_lam_0_0-0 " in err, err
    domains = ["CheXpert", "OpenI", "RSNA", "VinBigData"]
    for m, acc in (("pfeddb_one_phase", 0.6), ("pfeddb", 0.8)):
        d = tmp_path / "results" / "pfeddb" / "quickstart" / "pfeddb_cxr4" / m / "seed0"
        d.mkdir(parents=True)
        hist = [{"round": 1, "train_seconds": 1.0, "bytes_up_total": 8, "bytes_down_total": 8, "sampled": domains,
                 "eval": {c: {"acc": acc} for c in domains}, "mean_acc": acc}]
        met = {"per_client": {c: {"acc": acc} for c in domains}, "client_domains": {c: c for c in domains},
               "bytes_up_per_round": [8], "bytes_down_per_round": [8], "model_param_bytes": 8}
        (d / "metrics.json").write_text(json.dumps(met))
        (d / "history.json").write_text(json.dumps(hist))
    assert main([*params, "report", "--group", "table4", "--experiment", "pfeddb_cxr4"]) == 0
    table = (tmp_path / "results" / "pfeddb" / "quickstart" / "groups" / "table4" / "pfeddb_cxr4" / "pfeddb_cxr4_accuracy.md").read_text()
    assert "| pfeddb_one_phase | 60.0 |" in table and "| pfeddb | **80.0** |" in table and "| fedavg |" not in table
    # Table 4's published row beside ours (a row of the accuracy table under the variant's key), and Table 3's Param
    # and Ratio beside the measured upload
    group = tmp_path / "results" / "pfeddb" / "quickstart" / "groups" / "table4" / "pfeddb_cxr4"
    vs = (group / "pfeddb_cxr4_vs_paper.md").read_text()
    assert "| pfeddb_one_phase | 60.0 / 83.5 (-23.5) |" in vs and "60.0 / 81.3 (-21.3) |" in vs, vs
    assert "| pfeddb | 80.0 / 85.4 ± 2.5 (-5.4) |" in vs and "80.0 / 83.4 ± 0.7 (-3.4) |" in vs, vs  # the appendix's std
    csv = pd.read_csv(group / "pfeddb_cxr4_vs_paper.csv", index_col=0)
    assert csv.loc["pfeddb", "Avg_paper_std"] == 0.7 and pd.isna(csv.loc["pfeddb_one_phase", "Avg_paper_std"])
    comm = (group / "pfeddb_cxr4_communication.md").read_text()
    assert "paper: Param (MB, as printed) | paper: ratio |" in comm and comm.count("| – | – |") == 1, comm
    assert "| 18.2 | 0.68 |" in comm, comm
    assert not (tmp_path / "results" / "pfeddb" / "quickstart" / "report").exists()  # the report stages' outputs untouched
    # the report stage's output holds each group's table of the experiment too, rebuilt with it after a retrain
    from fedsilo.config import load_params

    every = load_params(REPO / "pipelines" / "pfeddb" / "params.yaml").experiment_methods("pfeddb_cxr4")
    write_run = lambda m, acc: ((d := tmp_path / "results" / "pfeddb" / "quickstart" / "pfeddb_cxr4" / m / "seed0").mkdir(  # noqa: E731
        parents=True, exist_ok=True), (d / "metrics.json").write_text(json.dumps({**met, "per_client": {c: {"acc": acc} for c in domains}})),
        (d / "history.json").write_text(json.dumps([{**hist[0], "eval": {c: {"acc": acc} for c in domains}, "mean_acc": acc}])))
    for m in every:
        if m not in ("pfeddb_one_phase", "pfeddb"):
            write_run(m, 0.5)
    assert main([*params, "report", "--experiment", "pfeddb_cxr4"]) == 0
    report = tmp_path / "results" / "pfeddb" / "quickstart" / "report" / "pfeddb_cxr4"
    group = report / "groups" / "table4" / "pfeddb_cxr4_accuracy.md"
    assert "| pfeddb_one_phase | 60.0 |" in group.read_text() and "| fedavg |" not in group.read_text()
    assert "| fedavg | 50.0 |" in (report / "pfeddb_cxr4_accuracy.md").read_text()
    assert "- [table4](groups/table4/README.md): pfeddb_one_phase, pfeddb" in (report / "README.md").read_text()
    main_table = (report / "groups" / "tables_1_2" / "pfeddb_cxr4_accuracy.md").read_text()
    assert "| fedavg | 50.0 |" in main_table and "| pfeddb_one_phase |" not in main_table
    assert not [x.name for x in report.parent.iterdir() if x.name.startswith(".")]  # no temporary folder left beside it
    write_run("pfeddb_one_phase", 0.7)  # retrained: the stage's next run rewrites the group's table with the rest
    assert main([*params, "report", "--experiment", "pfeddb_cxr4"]) == 0
    assert "| pfeddb_one_phase | 70.0 |" in group.read_text()
    assert main([*params, "report", "--group", "table4", "--experiment", "pfeddb_digits5"]) == 2
    assert "runs.table4.experiments: 'pfeddb_digits5' is not one of them (pfeddb_office, pfeddb_cxr4)" in capsys.readouterr().err
    assert main([*params, "report", "--group", "table9"]) == 2
    assert "runs.table9: no such run group (groups: tables_1_2," in capsys.readouterr().err
    assert main([*params, "report", "--group", "table4", "--sensitivity"]) == 2
    assert "--sensitivity and --group: one or the other" in capsys.readouterr().err


def test_the_report_command_refuses_what_it_cannot_report_naming_the_flags(tmp_path, capsys):
    """`fedsilo report` refuses by flag, before any table: --methods with --group, --methods naming nothing, --across
    with another flag, --group of a params file that is not a paper's."""
    from fedsilo.cli import main
    from tests.conftest import REPO

    (tmp_path / "pipelines").symlink_to(REPO / "pipelines")
    params = ["--params", str(REPO / "pipelines" / "pfeddb" / "params.yaml"), "--root", str(tmp_path)]
    for args, said in ((["--group", "table4", "--experiment", "pfeddb_cxr4", "--methods", "pfeddb"],
                        "--methods: with --experiment and without --group (one experiment's chosen methods)"),
                       (["--experiment", "pfeddb_cxr4", "--methods", ","], "--methods: name at least one method"),
                       (["--across", "tables_1_2", "--experiment", "pfeddb_cxr4"], "--across: alone (one run group's table across")):
        capsys.readouterr()
        assert main([*params, "report", *args]) == 2, args
        assert said in capsys.readouterr().err, args
    assert main(["--params", str(REPO / "params.yaml"), "--root", str(tmp_path), "report", "--group", "table4"]) == 2
    assert "--group: " in (err := capsys.readouterr().err) and "is not a paper's params file" in err, err
    assert not (tmp_path / "results").exists()


def test_a_run_folder_without_metrics_is_not_trained_and_a_groups_refusal_names_only_the_stage_that_trains_it(tmp_path, capsys):
    """An interrupted run leaves its folder (a checkpoint) without metrics.json: `report --group` still counts it not
    trained, and names the one `dvc repro` target that trains it (the "report the methods trained" hint is the whole
    experiment's report's, not a group's)."""
    from fedsilo.cli import main
    from tests.conftest import REPO

    (tmp_path / "pipelines").symlink_to(REPO / "pipelines")
    params = ["--params", str(REPO / "pipelines" / "pfeddb" / "params.yaml"), "--root", str(tmp_path)]
    runs = tmp_path / "results" / "pfeddb" / "quickstart" / "pfeddb_cxr4"
    (runs / "pfeddb_one_phase" / "seed0").mkdir(parents=True)
    (runs / "pfeddb_one_phase" / "seed0" / "checkpoint.pt").write_bytes(b"")
    (runs / "pfeddb" / "seed0").mkdir(parents=True)
    (runs / "pfeddb" / "seed0" / "metrics.json").write_text("{}")
    capsys.readouterr()
    assert main([*params, "report", "--group", "table4", "--experiment", "pfeddb_cxr4"]) == 2
    err = capsys.readouterr().err.strip()
    assert ("runs.table4: 1 run(s) not trained yet (pfeddb_cxr4/pfeddb_one_phase/seed0); train them: dvc repro "
            "pipelines/pfeddb/dvc.yaml:train_table4@pfeddb_cxr4-pfeddb_one_phase-0") in err, err
    assert err.endswith("train_table4@pfeddb_cxr4-pfeddb_one_phase-0"), err


def test_a_group_across_experiments_gets_one_table_and_figure_over_the_setting_that_tells_them_apart(tmp_path, capsys):
    """CD2-pFed's Fig. 5 (`report --group fig5`): its methods' Avg on s = 3, 5, 10 and on Tables 1-2's s = 2
    (``beside_experiments``), columns labelled and ordered by classes_per_client; a missing s = 2 run is named."""
    import json

    from fedsilo.cli import main
    from tests.conftest import REPO

    (tmp_path / "pipelines").symlink_to(REPO / "pipelines")
    params = ["--params", str(REPO / "pipelines" / "cd2pfed" / "params.yaml"), "--root", str(tmp_path)]
    methods, s_of = ["fedavg", "lgfedavg", "fedper", "cd2pfed"], {"cd2_digits_s2": 2, "cd2_digits_s3": 3, "cd2_digits_s5": 5, "cd2_digits_s10": 10}

    def write(exp, m, acc):
        d = tmp_path / "results" / "cd2pfed" / "quickstart" / exp / m / "seed0"
        d.mkdir(parents=True, exist_ok=True)
        clients = ["client00", "client01"]
        (d / "metrics.json").write_text(json.dumps({"per_client": {c: {"acc": acc} for c in clients}, "bytes_up_per_round": [8],
                                                    "bytes_down_per_round": [8], "model_param_bytes": 8}))
        (d / "history.json").write_text(json.dumps([{"round": 1, "train_seconds": 1.0, "bytes_up_total": 8, "bytes_down_total": 8,
                                                     "sampled": clients, "eval": {c: {"acc": acc} for c in clients}, "mean_acc": acc}]))

    for exp, s in s_of.items():
        for i, m in enumerate(methods):
            if (exp, m) != ("cd2_digits_s2", "cd2pfed"):
                write(exp, m, 0.1 * i + 0.01 * s)
    capsys.readouterr()
    assert main([*params, "report", "--group", "fig5"]) == 2
    err = capsys.readouterr().err
    # Table 1's run the figure needs, refused before any of the group's tables, with the stage that trains it
    assert "runs.fig5: 1 run(s) not trained yet (cd2_digits_s2/cd2pfed/seed0); train them: dvc repro " in err, err
    assert not (tmp_path / "results" / "cd2pfed" / "quickstart" / "groups").exists()
    write("cd2_digits_s2", "cd2pfed", 0.32)
    assert main([*params, "report", "--group", "fig5"]) == 0
    out = tmp_path / "results" / "cd2pfed" / "quickstart" / "groups" / "fig5" / "across"
    md = (out / "fig5_across.md").read_text()
    assert "| method | classes_per_client 2 | classes_per_client 3 | classes_per_client 5 | classes_per_client 10 |" in md, md
    assert "| cd2pfed | 32.0 | 33.0 | 35.0 | 40.0 |" in md and "classes_per_client 3: cd2_digits_s3" in md
    assert (out / "fig5_across.png").stat().st_size > 0


def test_which_groups_get_a_table_across_experiments_and_how_their_columns_are_named_and_ordered(tmp_path):
    from fedsilo.config import ConfigError, across_blocks, load_paper_params
    from fedsilo.fl.params import load_params
    from fedsilo.report.across import experiment_labels

    cd2 = load_params(REPO / "pipelines" / "cd2pfed" / "params.yaml")
    assert across_blocks("fig5", cd2.paper.runs["fig5"], cd2.experiments) == {
        "digits5_16": ["cd2_digits_s2", "cd2_digits_s3", "cd2_digits_s5", "cd2_digits_s10"]}
    assert [g for g, grp in cd2.paper.runs.items() if grp.across] == ["fig5"]  # a group's choice, checked on load:
    raw = yaml.safe_load((REPO / "pipelines" / "cd2pfed" / "params.yaml").read_text())
    raw["runs"]["project_label_skew"]["across"] = True  # Office, PACS, Chest-X-Ray-4: one experiment each
    with pytest.raises(ConfigError, match=re.escape("runs.project_label_skew.across: 'cd2_office_s2' is the group's only "
                                                    "experiment on office_caltech10_16; a table across experiments sets two")):
        load_paper_params(REPO / "pipelines" / "cd2pfed" / "params.yaml", raw)
    raw = yaml.safe_load((REPO / "pipelines" / "cd2pfed" / "params.yaml").read_text())
    raw["runs"]["tables_1_2"]["published"] = "pipelines/cd2pfed/published.yaml#x"
    with pytest.raises(ConfigError, match=re.escape("runs.tables_1_2.published: the paper's numbers of a table across "
                                                    "experiments; set runs.tables_1_2.across: true")):
        load_paper_params(REPO / "pipelines" / "cd2pfed" / "params.yaml", raw)
    raw = yaml.safe_load((REPO / "pipelines" / "pfeddil" / "params.yaml").read_text())
    raw["runs"]["fig2"]["across"] = True  # task streams: `report --sensitivity`
    with pytest.raises(ConfigError, match=r"runs\.fig2\.across: '\w+' is a task stream"):
        load_paper_params(REPO / "pipelines" / "pfeddil" / "params.yaml", raw)
    labels, order, axis = experiment_labels({"s10": {"split.classes_per_client": 10, "train.lr": 0.1},
                                             "s2": {"split.classes_per_client": 2, "train.lr": 0.1}})
    assert order == ["s2", "s10"] and labels == {"s10": "classes_per_client 10", "s2": "classes_per_client 2"}
    assert axis == ("classes_per_client", {"s10": "10", "s2": "2"})
    labels, order, axis = experiment_labels({"a": {"split.domain_order": ["MNIST", "USPS"]}, "b": {"split.domain_order": ["MNIST", "SVHN"]}})
    assert order == ["a", "b"] and axis == ("domain_order", {"a": "['MNIST', 'USPS']", "b": "['MNIST', 'SVHN']"})
    assert experiment_labels({"a": {"x": 1}, "b": {"x": 1}})[0] == {"a": "a", "b": "b"}  # nothing tells them apart
    # FedeCouple's join ratios: a fraction and a range apart: the experiments' names, no axis (points, not a line)
    rho = {"rho_0_1_to_1": {"train.client_fraction": 1.0, "train.client_fraction_range": [0.1, 1.0]},
           "rho_0_5": {"train.client_fraction": 0.5, "train.client_fraction_range": None}}
    assert experiment_labels(rho) == ({"rho_0_1_to_1": "rho_0_1_to_1", "rho_0_5": "rho_0_5"}, ["rho_0_1_to_1", "rho_0_5"], None)
    # such columns are named by the experiments, each with the settings that set it apart
    from fedsilo.report.across import build_across_report

    avg = {e: pd.DataFrame({"mean": [50.0], "std": [None]}, index=["fedrep"]) for e in rho}
    build_across_report("fig12", {"cifar10_32": list(rho)}, avg, rho, ["fedrep"], [0], tmp_path / "fig12")
    md = (tmp_path / "fig12" / "fig12_across.md").read_text()
    assert ("Columns: rho_0_1_to_1: client_fraction 1.0, client_fraction_range [0.1, 1.0]; rho_0_5: client_fraction 0.5, "
            "client_fraction_range None.") in md and "| method | rho_0_1_to_1 | rho_0_5 |" in md
    assert "**Several settings apart**: the experiments differ in client_fraction, client_fraction_range" in md
    assert "No published numbers beside these" in md
    # beside_experiments names experiments another group trains the group's methods on: checked when params load
    raw = yaml.safe_load((REPO / "pipelines" / "cd2pfed" / "params.yaml").read_text())
    for bad, said in ((["cd2_digits_s3"], "runs.fig5.beside_experiments: 'cd2_digits_s3' is one of the group's own experiments"),
                      (["cd2_digits_s2", "cd2_digits_s2"], "runs.fig5.beside_experiments: cd2_digits_s2 listed twice"),
                      (["cd2_digits_s4"], "runs.fig5.beside_experiments: 'cd2_digits_s4' is not defined under 'experiments' (did you mean")):
        raw["runs"]["fig5"]["beside_experiments"] = bad
        with pytest.raises(ConfigError, match=re.escape(said)):
            load_paper_params(REPO / "pipelines" / "cd2pfed" / "params.yaml", raw)


def test_a_table_across_several_datasets_has_a_row_per_dataset_and_the_papers_rows_under_ours(tmp_path):
    """FedeCouple's Table XII: local epochs on two datasets, E = 5 from another group's experiment; one column per
    E (the union, in order), a row per method and dataset, the paper's numbers under ours (CSV: source ours |
    paper), dashed in the figure; the paper's numbers must name the table's setting, rows and values."""
    from fedsilo.report import ReportError
    from fedsilo.report.across import build_across_report

    blocks = {"cifar10_32": ["c5", "c1", "c10"], "fmnist_28": ["f5", "f1"]}
    epochs = {"c5": 5, "c1": 1, "c10": 10, "f5": 5, "f1": 1}
    settings = {e: {"train.local_epochs": k, "train.lr": 0.02 if e[0] == "c" else 0.01} for e, k in epochs.items()}
    avg = {e: pd.DataFrame({"mean": [50.0 + k + (30 if e[0] == "f" else 0)], "std": [0.5]}, index=["fedecouple"]) for e, k in epochs.items()}
    paper = {"source": "Table XII", "setting": "local_epochs",
             "methods": {"fedecouple": {"cifar10_32": {1: 76.76, 5: 81.78, 10: 79.86}, "fmnist_28": {1: 90.78}}}}
    got = build_across_report("table12", blocks, avg, settings, ["fedecouple"], [0, 1], tmp_path / "out",
                              (paper, "published.yaml#table12"))
    assert got["columns"] == ["local_epochs 1", "local_epochs 5", "local_epochs 10"]
    md = (tmp_path / "out" / "table12_across.md").read_text()
    assert "| method | dataset | local_epochs 1 | local_epochs 5 | local_epochs 10 |" in md
    assert "| fedecouple | cifar10_32 | 51.0 ± 0.5 | 55.0 ± 0.5 | 60.0 ± 0.5 |\n| paper | cifar10_32 | 76.76 | 81.78 | 79.86 |" in md
    assert "| fedecouple | fmnist_28 | 81.0 ± 0.5 | 85.0 ± 0.5 | n/a |\n| paper | fmnist_28 | 90.78 | – | – |" in md
    assert "fmnist_28: local_epochs 1: f1, local_epochs 5: f5" in md and "Several settings apart" not in md
    csv = pd.read_csv(tmp_path / "out" / "table12_across.csv")
    assert list(dict.fromkeys(csv[["dataset", "source"]].itertuples(index=False, name=None))) == [
        ("cifar10_32", "ours"), ("cifar10_32", "paper"), ("fmnist_28", "ours"), ("fmnist_28", "paper")]
    assert list(csv.columns) == ["method", "dataset", "source", "column", "setting", "value", "mean", "std"]
    cell = csv.set_index(["dataset", "source", "value"])
    assert cell.loc[("cifar10_32", "paper", 5), "mean"] == 81.78 and cell.loc[("cifar10_32", "ours", 10), "mean"] == 60.0
    assert cell.loc[("cifar10_32", "ours", 10), "std"] == 0.5 and set(csv["setting"]) == {"local_epochs"}
    assert (tmp_path / "out" / "table12_across.png").stat().st_size > 0
    for bad, said in (({**paper, "setting": "rounds"}, "setting 'rounds' but the group's experiments differ in 'local_epochs'"),
                      ({**paper, "methods": {"fedecouple": {"cinic10_32": {1: 56.96}}}},
                       "methods.fedecouple.cinic10_32: no such row of the table (its rows: fedecouple on cifar10_32, fedecouple on "
                       "fmnist_28); the paper's numbers are of cinic10_32, this group's experiments of cifar10_32, fmnist_28"),
                      ({**paper, "methods": {"fedecouple": {"fmnist_28": {3: 91.93}}}}, "local_epochs 3 is none of the group's experiments")):
        with pytest.raises(ReportError, match=re.escape(said)):
            build_across_report("table12", blocks, avg, settings, ["fedecouple"], [0], tmp_path / "bad", (bad, "p#t"))
    for bad, said in (({**paper, "methods": {"fedecouple": {"fmnist_28": {1: None}}}}, "methods.fedecouple.fmnist_28: a mapping"),
                      ({**paper, "methods": {"fedecouple": {"fmnist_28": [90.78]}}}, "methods.fedecouple.fmnist_28: a mapping"),
                      ({**paper, "methods": ["fedecouple"]}, "methods: a mapping method -> dataset")):
        with pytest.raises(ReportError, match=re.escape(said)):
            build_across_report("table12", blocks, avg, settings, ["fedecouple"], [0], tmp_path / "bad", (bad, "p#t"))
    with pytest.raises(ReportError, match=re.escape("runs.table12: fedrep is not in c5's accuracy table")):
        build_across_report("table12", blocks, avg, settings, ["fedecouple", "fedrep"], [0], tmp_path / "bad", None)
    twin = {**blocks, "fmnist_28": ["f5", "f1", "f1b"]}  # two experiments of one column: refused, not overwritten
    with pytest.raises(ReportError, match=re.escape("runs.table12.across: 'f1' and 'f1b' on fmnist_28 have the same settings")):
        build_across_report("table12", twin, {**avg, "f1b": avg["f1"]}, {**settings, "f1b": settings["f1"]}, ["fedecouple"], [0],
                            tmp_path / "bad", None)
    settings["f1"] = {"train.local_epochs": 1, "train.lr": 0.05}  # fmnist's two differ in the rate too
    with pytest.raises(ReportError, match=re.escape("runs.table12.across: on fmnist_28 the experiments f5, f1 differ in "
                                                    "local_epochs, lr")):
        build_across_report("table12", blocks, avg, settings, ["fedecouple"], [0], tmp_path / "bad", None)
    assert not (tmp_path / "bad").exists()


def test_the_across_figure_plots_each_row_at_the_settings_values_and_the_papers_dashed_in_its_colour(tmp_path, monkeypatch):
    """The across figure's data: x at the setting's values (local epochs 1, 5, 10 spaced as numbers, not 0, 1, 2),
    ours the table's means, the paper's row beside it dashed in the colour of ours with a gap where it prints no
    number (not a zero); columns named by experiments (several settings apart) are points at 0, 1, ... (no line)."""
    import fedsilo.report.across as across

    drawn: dict[str, tuple] = {}
    monkeypatch.setattr(across, "line_figure", lambda path, series, *a, **k: drawn.__setitem__(path.name, (series, k)) or path.name)
    epochs = {"e10": 10, "e1": 1, "e5": 5}
    settings = {e: {"train.local_epochs": k} for e, k in epochs.items()}
    avg = {e: pd.DataFrame({"mean": [50.0 + k, 40.0 + k], "std": [0.5, 0.5]}, index=["fedecouple", "fedavg"]) for e, k in epochs.items()}
    paper = {"source": "Table XII", "setting": "local_epochs", "methods": {"fedecouple": {"c10": {1: 76.76, 5: 81.78}}}}
    across.build_across_report("t12", {"c10": list(epochs)}, avg, settings, ["fedecouple", "fedavg"], [0], tmp_path / "out",
                               (paper, "p#t"))
    series, kw = drawn["t12_across.png"]
    lines = {label: (x, y) for label, x, y in series}
    assert list(lines) == ["fedecouple", "fedecouple (paper)", "fedavg"]
    assert lines["fedecouple"] == ([1.0, 5.0, 10.0], [51.0, 55.0, 60.0]) and lines["fedavg"][1] == [41.0, 45.0, 50.0]
    x, y = lines["fedecouple (paper)"]
    assert x == [1.0, 5.0, 10.0] and y[:2] == [76.76, 81.78] and np.isnan(y[2])
    styles = kw["styles"]
    assert styles["fedecouple (paper)"]["linestyle"] == "--" and styles["fedecouple (paper)"]["color"] == styles["fedecouple"]["color"]
    assert styles["fedecouple"]["color"] != styles["fedavg"]["color"]
    assert kw["connect"] and kw["xtick_positions"] == [1.0, 5.0, 10.0] and kw["xticks"] == ["1", "5", "10"]
    assert all(s.get("linestyle", "-") != "none" for s in styles.values())
    rho = {"rho_a": {"train.client_fraction": 1.0, "train.client_fraction_range": [0.1, 1.0]},
           "rho_b": {"train.client_fraction": 0.5, "train.client_fraction_range": None}}
    across.build_across_report("f12", {"c10": list(rho)}, {e: avg["e1"] for e in rho}, rho, ["fedavg"], [0], tmp_path / "f12")
    series, kw = drawn["f12_across.png"]
    assert series == [("fedavg", [0, 1], [41.0, 41.0])] and kw["xticks"] == ["rho_a", "rho_b"] and kw["xtick_positions"] is None
    assert not kw["connect"] and kw["styles"]["fedavg"]["linestyle"] == "none"


def test_datasets_whose_experiments_differ_in_different_settings_make_no_table_across_them(tmp_path):
    """Across several datasets the columns are one setting's values: one dataset swept over local epochs and the
    other over the learning rate have no common columns, and the group is refused naming both settings; a setting
    of True / False is no scale (kept in the order given, points not joined by a line)."""
    from fedsilo.report import ReportError
    from fedsilo.report.across import build_across_report, experiment_labels

    settings = {"c1": {"train.local_epochs": 1, "train.lr": 0.1}, "c5": {"train.local_epochs": 5, "train.lr": 0.1},
                "f1": {"train.local_epochs": 1, "train.lr": 0.01}, "f2": {"train.local_epochs": 1, "train.lr": 0.02}}
    avg = {e: pd.DataFrame({"mean": [50.0], "std": [0.5]}, index=["fedavg"]) for e in settings}
    with pytest.raises(ReportError, match=re.escape("runs.g.across: the datasets' experiments differ in local_epochs, lr;")):
        build_across_report("g", {"cifar10_32": ["c1", "c5"], "fmnist_28": ["f1", "f2"]}, avg, settings, ["fedavg"], [0], tmp_path / "g")
    assert not (tmp_path / "g").exists()
    labels, order, axis = experiment_labels({"on": {"split.every_class": True}, "off": {"split.every_class": False}})
    assert order == ["on", "off"] and labels == {"on": "every_class True", "off": "every_class False"}
    assert axis == ("every_class", {"on": "True", "off": "False"})
    from fedsilo.report.across import _numbers

    assert not _numbers(axis)


def test_the_papers_across_numbers_must_name_the_setting_and_be_numbers_and_our_std_comes_from_the_accuracy_csv(tmp_path):
    """A published across entry without its ``setting``, or with True for a mean (YAML's yes), is refused, not
    set beside ours; an experiment's Avg and its std over seeds come from the report stage's accuracy CSV (no
    Avg_std column: no spread); setting keys whose short names collide (split.seed, train.seed) keep their prefixes."""
    from fedsilo.report import ReportError
    from fedsilo.report.across import avg_from_csv, build_across_report, differing

    settings = {"e1": {"train.local_epochs": 1}, "e5": {"train.local_epochs": 5}}
    avg = {e: pd.DataFrame({"mean": [50.0], "std": [0.5]}, index=["fedecouple"]) for e in settings}
    for bad, said in (({"methods": {"fedecouple": {"c10": {1: 76.76}}}}, "setting 'None' but the group's experiments differ in 'local_epochs'"),
                      ({"setting": "local_epochs", "methods": {"fedecouple": {"c10": {1: True}}}}, "methods.fedecouple.c10: a mapping")):
        with pytest.raises(ReportError, match=re.escape(said)):
            build_across_report("t", {"c10": list(settings)}, avg, settings, ["fedecouple"], [0], tmp_path / "bad", (bad, "p#t"))
    assert not (tmp_path / "bad").exists()
    pd.DataFrame({"method": ["fedavg", "fedecouple"], "seeds": [2, 2], "Avg_mean": [40.0, 61.0], "Avg_std": [1.5, 2.5]}).to_csv(
        tmp_path / "a.csv", index=False)
    got = avg_from_csv(tmp_path / "a.csv", "e")
    assert got.loc["fedecouple", "mean"] == 61.0 and got.loc["fedecouple", "std"] == 2.5 and got.loc["fedavg", "std"] == 1.5
    pd.DataFrame({"method": ["fedavg"], "seeds": [1], "Avg_mean": [40.0]}).to_csv(tmp_path / "one.csv", index=False)
    assert np.isnan(avg_from_csv(tmp_path / "one.csv", "e").loc["fedavg", "std"])
    assert differing({"a": {"split.seed": 0, "train.seed": 0, "train.lr": 0.1}, "b": {"split.seed": 1, "train.seed": 1, "train.lr": 0.1}}
                     ) == {"split.seed": "split.seed", "train.seed": "train.seed"}
    assert differing({"a": {"split.seed": 0, "train.lr": 0.1}, "b": {"split.seed": 1, "train.lr": 0.2}}) == {"split.seed": "seed", "train.lr": "lr"}


def test_the_across_stage_builds_a_groups_table_from_the_report_stages_accuracy_tables(tmp_path, capsys):
    """`report --across table12` (dvc.yaml's across_table12 stage) reads each experiment's <e>_accuracy.csv under
    report/ (what the stage depends on) and writes results/<paper>/<scale>/across/table12/; a report not built yet
    is named with its stage; a group without `across` is refused."""
    from fedsilo.cli import main

    (tmp_path / "pipelines").symlink_to(REPO / "pipelines")
    params = ["--params", str(REPO / "pipelines" / "fedecouple" / "params.yaml"), "--root", str(tmp_path)]
    report = tmp_path / "results" / "fedecouple" / "quickstart" / "report"
    for e, acc in (("fc_digits_s20", 61.0), ("fc_digits_s20_e1", 40.0)):
        (report / e).mkdir(parents=True)
        pd.DataFrame({"method": ["fedavg_ft", "fedecouple"], "seeds": [1, 1], "Avg_mean": [10.0, acc], "Avg_std": [None, None]}
                     ).to_csv(report / e / f"{e}_accuracy.csv", index=False)
    assert main([*params, "report", "--across", "table12"]) == 2
    err = capsys.readouterr().err
    assert "fc_digits_s20_e10_accuracy.csv: not found" in err and "report@fc_digits_s20_e10" in err, err
    (report / "fc_digits_s20_e10").mkdir()
    pd.DataFrame({"method": ["fedecouple"], "seeds": [1], "Avg_mean": [66.5], "Avg_std": [None]}).to_csv(
        report / "fc_digits_s20_e10" / "fc_digits_s20_e10_accuracy.csv", index=False)
    assert main([*params, "report", "--across", "table12"]) == 0
    md = (tmp_path / "results" / "fedecouple" / "quickstart" / "across" / "table12" / "table12_across.md").read_text()
    assert "| method | local_epochs 1 | local_epochs 5 | local_epochs 10 |\n|---|---|---|---|\n| fedecouple | 40.0 | 61.0 | 66.5 |" in md
    assert main([*params, "report", "--across", "tables_2_7"]) == 2
    assert "runs.tables_2_7.across is not set" in capsys.readouterr().err
    assert main([*params, "report", "--across", "table99"]) == 2
    assert "--across: " in capsys.readouterr().err


def test_a_variant_that_differs_from_its_method_beyond_its_own_keys_is_named():
    """A tuned ``methods.cd2pfed`` leaves the ablations that name it at the registered defaults for every key they do
    not set: the report names each such key; keys a variant sets itself, or that its values make idle (pFedDB's Phase-1
    settings without the two-phase protocol), are not a difference."""
    from fedsilo.report.versus import variant_drift

    entries = {"cd2pfed": {"p": 0.25, "lam": 1.0}, "cd2pfed_cd": {"method": "cd2pfed", "progressive": False, "temporal_averaging": False, "lam": 2.0},
               "fedavg": {}}
    assert variant_drift(entries, ["cd2pfed", "cd2pfed_cd", "fedavg"]) == ["cd2pfed_cd takes p 0.5 (cd2pfed: 0.25)"]
    assert variant_drift(entries, ["cd2pfed_cd", "fedavg"]) == []  # without its method in the table: nothing to compare
    entries["cd2pfed_cd"]["p"] = 0.25
    assert variant_drift(entries, ["cd2pfed", "cd2pfed_cd"]) == []
    pfeddb = {"pfeddb": {"local_rounds": 4, "phase1_lr": 0.01}, "pfeddb_one_phase": {"method": "pfeddb", "two_phase": False}}
    assert variant_drift(pfeddb, list(pfeddb)) == []
    pfeddb["pfeddb"]["fusion"] = "concat"
    assert variant_drift(pfeddb, list(pfeddb)) == ["pfeddb_one_phase takes fusion 'add' (pfeddb: 'concat')"]
    # FedeCouple's lambda does nothing without GPC, mu nothing without GFA
    fc = {"fedecouple": {"lam": 0.5, "mu": 5.0}, "fedecouple_no_gpc": {"method": "fedecouple", "gpc": False},
          "fedecouple_none": {"method": "fedecouple", "glf": False, "gfa": False, "gpc": False, "da": False}}
    assert variant_drift(fc, list(fc)) == ["fedecouple_no_gpc takes mu 2.0 (fedecouple: 5.0)"]


def test_latex_tables_escape_names_and_a_table_of_identical_rows_says_it_tells_nothing():
    from fedsilo.report.tables import indistinct_rows, latex_text, to_latex
    from fedsilo.report.versus import versus_paper

    cols = ["art_painting", "Avg"]
    acc = pd.concat({"mean": pd.DataFrame([[50.0, 60.0], [50.0, 60.0]], index=["f2dc_no_dfd", "fedavg"], columns=cols),
                     "std": pd.DataFrame([[1.0, 2.0], [1.0, 2.0]], index=["f2dc_no_dfd", "fedavg"], columns=cols)}, axis=1)
    tex = to_latex(acc, f"{latex_text('f2dc_office')}: 50% & more")
    assert "f2dc\\_no\\_dfd &" in tex and "art\\_painting" in tex and "\\caption{f2dc\\_office" in tex
    body = tex.replace("\\_", "")
    assert "_" not in body, "a bare underscore stops LaTeX outside math mode"
    assert "all 2 methods scored the same" in indistinct_rows(acc)
    perfect = pd.concat({"mean": pd.DataFrame(100.0, index=["a", "b"], columns=cols), "std": pd.DataFrame(0.0, index=["a", "b"], columns=cols)}, axis=1)
    assert "every test image right in every run" in indistinct_rows(perfect) and "one class" not in indistinct_rows(perfect)
    acc.loc["fedavg", ("mean", "Avg")] = 61.0
    assert indistinct_rows(acc) is None
    # some rows tie, others do not (pFedDIL's ablations on a quickstart stream beside a learning FedCIL): named
    three = pd.concat({"mean": pd.DataFrame([[50.0, 60.0], [50.0, 60.0], [70.0, 75.0]], index=["a", "b", "fedcil"], columns=cols),
                       "std": pd.DataFrame(0.0, index=["a", "b", "fedcil"], columns=cols)}, axis=1)
    assert indistinct_rows(three).startswith("scored exactly the same in every column: a, b. The same predictions: models that each predict one class")
    assert "or settings that change nothing on these data" in indistinct_rows(three)
    # a label-skew table's one pooled column: a and b meet on the mean over their clients, not on each client
    clients = pd.DataFrame([[0.5, 0.7], [0.7, 0.5], [0.9, 0.8]], index=["a", "b", "fedcil"],
                           columns=pd.MultiIndex.from_tuples([(0, "c0"), (0, "c1")], names=["seed", "client"]))
    assert indistinct_rows(three, clients) is None
    clients.loc["b"] = [0.5, 0.7]
    assert indistinct_rows(three, clients).startswith("scored exactly the same in every column: a, b.")
    # two tied groups: numbered, so a reader does not take the five for one tie
    five = pd.concat({"mean": pd.DataFrame([[50.0, 60.0], [50.0, 60.0], [70.0, 75.0], [70.0, 75.0], [10.0, 5.0]],
                                           index=["a", "b", "c", "d", "e"], columns=cols),
                      "std": pd.DataFrame(0.0, index=list("abcde"), columns=cols)}, axis=1)
    assert indistinct_rows(five).startswith("scored exactly the same in every column: 2 groups, each tied within itself: "
                                            "(1) a, b; (2) c, d. The same predictions")
    # a method the paper has no row for is in the versus table, paper "–"
    tab = versus_paper(acc, {"domains": ["art_painting"], "methods": {"fedavg": {"mean": [40.0, 50.0]}}})
    assert list(tab.index) == ["f2dc_no_dfd", "fedavg"] and pd.isna(tab.loc["f2dc_no_dfd", ("Avg", "paper")])


def test_a_stream_figure_marks_its_task_boundaries_and_keeps_fifteen_lines_apart(tmp_path, monkeypatch):
    """The stream-curves figure: a dotted line at each task boundary; with more lines than the default ten colours,
    a 20-colour map and the legend beside the axes."""
    from matplotlib.axes import Axes

    from fedsilo.report.figures import line_figure

    seen: dict[str, list] = {"vlines": [], "legend": []}
    for name, key in (("axvline", "vlines"), ("legend", "legend")):
        real = getattr(Axes, name)

        def spy(self, *a, _real=real, _key=key, **k):
            seen[_key].append(a[0] if a else k)
            return _real(self, *a, **k)

        monkeypatch.setattr(Axes, name, spy)
    series = [(f"m{i}", [1, 2, 3, 4, 5, 6], [i, i, i, i, i, i]) for i in range(15)]
    assert line_figure(tmp_path / "s.png", series, "acc", "stream", marks=(2.5, 4.5)) == "s.png"
    assert (tmp_path / "s.png").stat().st_size > 0
    assert seen["vlines"] == [2.5, 4.5] and seen["legend"][0]["bbox_to_anchor"] == (1.01, 1.0)


def test_a_lines_own_style_wins_over_the_defaults_and_ticks_stand_at_the_settings_values(tmp_path, monkeypatch):
    """line_figure: a label's ``styles`` (a paper's numbers dashed in the colour of ours) override the defaults, also
    ``connect=False``'s points-only; ``xticks`` stand at ``xtick_positions`` where given (local epochs 1, 5, 10), else
    at 0, 1, ...; past ten lines each takes its own colour of the 20-colour map."""

    from fedsilo.report.figures import line_figure

    seen: dict[str, list] = {"plot": [], "set_xticks": []}
    _spy_on_axes(monkeypatch, seen)
    series = [("ours", [1.0, 5.0, 10.0], [50.0, 55.0, 60.0]), ("ours (paper)", [1.0, 5.0, 10.0], [70.0, 75.0, 72.0])]
    styles = {"ours": {"color": "C0"}, "ours (paper)": {"color": "C0", "linestyle": "--", "marker": "x"}}
    line_figure(tmp_path / "a.png", series, "acc", "t", xlabel="local_epochs", xticks=["1", "5", "10"], connect=False,
                styles=styles, xtick_positions=[1.0, 5.0, 10.0])
    (_, ours), (_, theirs) = seen["plot"]
    assert ours["color"] == "C0" and ours["linestyle"] == "none" and ours["marker"] == "o"
    assert theirs["color"] == "C0" and theirs["linestyle"] == "--" and theirs["marker"] == "x"
    assert list(seen["set_xticks"][0][0][0]) == [1.0, 5.0, 10.0] and list(seen["set_xticks"][0][0][1]) == ["1", "5", "10"]
    seen["plot"].clear()
    seen["set_xticks"].clear()
    line_figure(tmp_path / "b.png", [(f"m{i}", [0, 1], [i, i]) for i in range(11)], "acc", "t", xticks=["e1", "e2"])
    assert list(seen["set_xticks"][0][0][0]) == [0, 1]
    colours = [k["color"] for _, k in seen["plot"]]
    assert None not in colours and len(set(colours)) == 11


def test_the_cost_table_sets_our_whole_rounds_upload_beside_the_papers_comm_and_names_what_it_lacks():
    """F²DC's Table 4 prints comm. for all of a round's clients (193.72 MB for FedAvg on PACS): ours is given per
    client and for the whole round; a paper method the report does not hold reads "not in this report" (it may have
    run, outside a group), not "not run"."""
    from fedsilo.report.versus import efficiency_markdown

    comm = pd.DataFrame({"upload_MiB": [18.721], "upload_round_bytes": [196_299_480.0], "train_s_per_round": [2.7]},
                        index=["f2dc"])
    paper = {"fedavg": {"upload_params": 5.43e7, "comm_MB": 193.72, "flops": 16.31e10, "train_s": 176.94},
             "f2dc": {"upload_params": 5.43e7, "comm_MB": 193.72, "flops": 16.46e10, "train_s": 180.67}}
    md = efficiency_markdown(comm, paper, "pacs")
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| f2dc") or line.startswith("| fedavg")}
    assert "| 18.721 | 187.2 MiB (196.3 MB) | – | 2.70 |" in rows["f2dc"] and "193.72 MB" in rows["f2dc"]
    assert rows["fedavg"].count("not in this report") == 4 and "not run" not in md
    assert "matches the upload of all of a round's clients" in md



def test_time_to_accuracy_vs_paper_sets_each_of_the_papers_numbers_in_its_own_column():
    """Table VII's rounds, MB and minutes differ on a row: each stands in its own column beside ours (MB in the
    paper's 1,024,000-byte unit, minutes from seconds), in the table and in the markdown's cells."""
    from fedsilo.report.versus import time_to_accuracy_versus, time_to_accuracy_versus_markdown

    ours = pd.DataFrame({"reached": ["2/3"], "round": [4.0], "train_s": [300.0], "MiB_per_client": [12 * 1_024_000 / 2**20]},
                        index=["fedecouple"])
    tab = time_to_accuracy_versus(ours, {"target": 70, "methods": {"fedecouple": {"rounds": 7, "comm_MB": 11.5, "minutes": 6.5}}})
    assert tab.loc["fedecouple"].drop("reached").tolist() == pytest.approx([4.0, 7.0, 12.0, 11.5, 5.0, 6.5])
    assert "| fedecouple | 2/3 | 4.0 / 7.0 | 12.0 / 11.5 | 5.0 / 6.5 |" in time_to_accuracy_versus_markdown(tab, "t")


def test_the_cost_table_keeps_the_papers_flops_and_time_apart_and_a_cost_not_measured_reads_as_a_dash():
    """Each of the paper's numbers stands under its own heading (FLOPs, then training time), and a cost of ours that
    is missing (NaN: no whole-round upload, no timed round) reads "–", never "nan"."""
    from fedsilo.report.versus import efficiency_markdown

    comm = pd.DataFrame({"upload_MiB": [1.5], "upload_round_bytes": [np.nan], "train_s_per_round": [np.nan],
                         "train_GFLOPs_per_round": [3.25]}, index=["f2dc"])
    paper = {"f2dc": {"upload_params": 5.43e7, "comm_MB": 193.72, "flops": 16.46e10, "train_s": 180.67}}
    row = next(line for line in efficiency_markdown(comm, paper, "pacs").splitlines() if line.startswith("| f2dc"))
    assert row == "| f2dc | 1.500 | – | 3.25 | – | 54300000.0 | 193.72 MB | 164600000000.0 | 180.67 s |"


def test_a_published_domain_our_runs_lack_is_refused_naming_our_domains():
    """versus_paper: a column of the paper's table that our accuracy table has not is a ReportError naming it and
    ours (a misspelt domain in published.yaml), not a KeyError."""
    from fedsilo.report import ReportError
    from fedsilo.report.versus import versus_paper

    acc = pd.concat({"mean": pd.DataFrame({"A": [50.0], "B": [70.0], "Avg": [60.0]}, index=["fedavg"])}, axis=1)
    with pytest.raises(ReportError, match=r"published table domains \['C'\] are not domains of this experiment \(\['A', 'B', 'Avg'\]\)"):
        versus_paper(acc, {"domains": ["A", "C"], "methods": {"fedavg": {"mean": [50.0, 70.0, 60.0]}}})


def test_a_published_file_without_the_across_table_asked_for_is_refused_naming_those_it_has(tmp_path):
    """``<file>#<key>`` of a group's across table: the entry under ``across``; a key the file has not (or whose entry is
    no mapping) is a ReportError naming the across tables it has, or none."""
    from fedsilo.report import ReportError
    from fedsilo.report.versus import load_published_across

    (tmp_path / "pub.yaml").write_text(yaml.safe_dump({"across": {"table12": {"source": "s", "methods": {}}, "table13": [1, 2]}}))
    assert load_published_across(tmp_path, "pub.yaml#table12") == {"source": "s", "methods": {}}
    for key in ("table14", "table13"):
        with pytest.raises(ReportError, match=rf"published: pub.yaml has no across table '{key}' \(has: table12, table13\)"):
            load_published_across(tmp_path, f"pub.yaml#{key}")
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump({"accuracy": {"table12": {"domains": ["A"]}}}))
    with pytest.raises(ReportError, match=r"has no across table 'table12' \(has: none\)"):
        load_published_across(tmp_path, "acc.yaml#table12")


def test_a_row_run_with_another_setting_than_the_papers_row_is_named():
    """The F²DC presets run every row the published file states the setting of (Sec. 5.1's defaults for f2dc, Table
    5's σ) with that setting; an edit of σ is named under the vs-paper table, not passed off as the paper's row."""
    import yaml

    from fedsilo.report.versus import settings_differ, write_versus

    published = yaml.safe_load((REPO / "pipelines/f2dc/published.yaml").read_text())["accuracy"]
    for preset in ("pipelines/f2dc/params.yaml", "pipelines/f2dc/paper/params.yaml"):
        entries = yaml.safe_load((REPO / preset).read_text())["methods"]
        for table in published.values():
            assert settings_differ(table, entries, list(entries)) == [], preset
    entries = yaml.safe_load((REPO / "pipelines/f2dc/params.yaml").read_text())["methods"]
    entries["f2dc"] = {**entries["f2dc"], "sigma": 0.2}
    said = settings_differ(published["pacs"], entries, ["fedavg", "f2dc", "f2dc_sigma_0_01"])
    assert said == ["f2dc ran with sigma 0.2 (the paper's row: 0.1)"]
    assert settings_differ(published["pacs"], {**entries, "f2dc_sigma_0_01": {"method": "f2dc"}}, ["f2dc_sigma_0_01"]) == [
        "f2dc_sigma_0_01 ran with sigma 0.1 (the paper's row: 0.01)"]  # the row's own value left at the default
    assert settings_differ(published["pacs"], {"fedavg": {}}, ["fedavg", "f2dc"]) == []  # a row with no entry here: nothing to compare
    idx = pd.MultiIndex.from_tuples([("Avg", "ours"), ("Avg", "paper"), ("Avg", "diff")])
    vs = pd.DataFrame([[70.0, 76.47, -6.47]], index=["f2dc"], columns=idx)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        md = write_versus(Path(d), "f2dc_pacs", vs, "pipelines/f2dc/published.yaml#pacs", published["pacs"], settings=said)
    assert "**Not the paper's setting**: f2dc ran with sigma 0.2 (the paper's row: 0.1)" in md
    import logging

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: warned.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fedsilo.report").addHandler(handler)
    try:  # once an experiment however many of its group tables repeat it; another experiment's line is its own
        for exp in ("f2dc_pacs_w", "f2dc_pacs_w", "f2dc_office_w"):
            with tempfile.TemporaryDirectory() as d:
                table = pd.DataFrame([[70.0, 76.47, -6.47]], index=["f2dc"], columns=idx)  # write_versus flattens it
                write_versus(Path(d), exp, table, "pipelines/f2dc/published.yaml#pacs", published["pacs"], settings=said)
    finally:
        logging.getLogger("fedsilo.report").removeHandler(handler)
    assert [w.split(":")[0] for w in warned if "not the paper's setting" in w] == ["f2dc_pacs_w", "f2dc_office_w"]
    # the paper's rows this table has no run of (here all but f2dc; a key misspelt in the file would be among them)
    unmatched = [m for m in published["pacs"]["methods"] if m != "f2dc"]
    assert unmatched and ("**The paper's rows with no run here**: " + ", ".join(unmatched) + " (methods this report does "
                          "not hold, or keys of pipelines/f2dc/published.yaml that name none of ours)") in md
    # F²DC's authors'-code run set beside the paper's F²DC row (row_of): said, as a setting that is not the paper's
    code = pd.DataFrame([[4.7, 76.47, -71.77]], index=["f2dc_code"], columns=idx)
    with tempfile.TemporaryDirectory() as d:
        md = write_versus(Path(d), "f2dc_pacs", code, "pipelines/f2dc/published.yaml#pacs", published["pacs"])
    assert "**Set beside another method's row**: f2dc_code (the paper's f2dc row): the paper has no row of these runs" in md
    assert "Set beside another" not in write_versus(Path(tempfile.mkdtemp()), "f2dc_pacs", pd.DataFrame(
        [[70.0, 76.47, -6.47]], index=["f2dc"], columns=idx), "pipelines/f2dc/published.yaml#pacs", published["pacs"])
    with tempfile.TemporaryDirectory() as d:
        whole = {**published["pacs"], "methods": {"f2dc": published["pacs"]["methods"]["f2dc"]}}
        fresh = pd.DataFrame([[70.0, 76.47, -6.47]], index=["f2dc"], columns=idx)  # write_versus flattens its columns
        assert "with no run here" not in write_versus(Path(d), "f2dc_pacs", fresh, "pipelines/f2dc/published.yaml#pacs", whole)


def test_the_backbone_note_names_what_the_runs_trained_where_it_is_not_the_papers(tmp_path):
    """The runs' backbones come from what each run's metrics.json records (``x<width>`` only where the width is not
    1; a run recording none is not counted); the vs-paper note is said when any backbone differs from the paper's
    (one run of a grid on another model is enough), and not when they match or nothing is known."""
    from fedsilo.report.versus import backbone_note, runs_backbones
    from fedsilo.utils.io import write_json

    trained = {("fedavg", 0): {"model": "resnet10"}, ("fedavg", 1): {"model": "resnet10", "model_width": 1.0},
               ("f2dc", 0): {"model": "resnet10", "model_width": 0.5}}
    for (m, s), train in trained.items():
        write_json(tmp_path / m / f"seed{s}" / "metrics.json", {"run": {"train": train}})
    write_json(tmp_path / "f2dc" / "seed1" / "metrics.json", {"mean_acc": 0.5})  # a run from before 2026-12-06
    assert runs_backbones(tmp_path, ["fedavg"], [0, 1]) == {"resnet10"}
    assert runs_backbones(tmp_path, ["fedavg", "f2dc"], [0, 1]) == {"resnet10", "resnet10 x0.5"}
    paper = {"backbone": "resnet10"}
    assert backbone_note(paper, {"resnet10"}) == "" and backbone_note(paper, set()) == "" and backbone_note({}, {"lenet5"}) == ""
    note = backbone_note(paper, {"resnet10", "resnet10 x0.5"})
    assert note.startswith("**Not the paper's backbone**: ours resnet10, resnet10 x0.5, the paper's resnet10:"), note


def test_a_quickstarts_vs_paper_table_says_where_its_scale_is_not_the_papers():
    """F²DC's quickstart trains the paper's ResNet-10 (no backbone note) at 16 px for 3 rounds on generated images:
    the vs-paper table names each setting beside the paper-scale params' and the mirrors; the paper scale says nothing."""
    from fedsilo.report.versus import paper_scale_note, write_versus
    from tests.conftest import paper_params

    p = paper_params("f2dc", "quickstart", check=False)
    note = paper_scale_note(p, "f2dc_pacs", REPO)
    assert note.startswith("**Not the paper's scale** (quickstart): ours image size 16 px, rounds 3, local epochs 1, batch size 16, seeds 1; "
                           "the paper scale's (pipelines/f2dc/paper/params.yaml) image size 128 px, rounds 100, local epochs 10, batch size 64, seeds 3; "
                           "our images from offline mirrors (pacs)"), note
    # the paper scale trains the paper's settings; on the mirrors (the root's default sources) it says so still
    assert paper_scale_note(paper_params("f2dc", "paper", check=False), "f2dc_pacs", REPO).startswith("**Not the paper's data** (paper): our images from offline mirrors")
    vs = pd.DataFrame({("Avg", "ours"): [20.0], ("Avg", "paper"): [70.0], ("Avg", "diff"): [-50.0]}, index=["f2dc"])
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        md = write_versus(Path(d), "f2dc_pacs", vs, "x.yaml#t", {"source": "Table 1"}, scale=note)
    assert note in md



def test_a_setting_the_paper_scales_params_leave_unsaid_is_not_named_as_a_difference(tmp_path):
    """Where the paper-scale params state no seeds (nor a value of some other setting), the scale note compares only
    what they state: the quickstart's one seed is not set beside a paper's "seeds 0"."""
    from fedsilo.report.versus import paper_scale_note
    from tests.conftest import paper_params

    raw = yaml.safe_load((REPO / "pipelines/f2dc/paper/params.yaml").read_text())
    del raw["seeds"]
    (tmp_path / "pipelines/f2dc/paper").mkdir(parents=True)
    (tmp_path / "pipelines/f2dc/paper/params.yaml").write_text(yaml.safe_dump(raw))
    note = paper_scale_note(paper_params("f2dc", "quickstart", check=False), "f2dc_pacs", tmp_path)
    assert note.startswith("**Not the paper's scale** (quickstart): ours image size 16 px, rounds 3, local epochs 1, batch size 16; "
                           "the paper scale's (pipelines/f2dc/paper/params.yaml) image size 128 px, rounds 100, local epochs 10, "
                           "batch size 64; our images from offline mirrors (pacs)"), note


def test_a_single_missing_run_is_not_sent_to_the_grid_and_several_are(tmp_path):
    """The refusal of a report whose runs are missing names `fedsilo grid` beside the `dvc repro` of its train stages
    only where there are several to train (one is one `dvc repro`)."""
    from fedsilo.cli import _refuse_missing_runs
    from fedsilo.config import ConfigError

    p = parse_params(small_params())
    with pytest.raises(ConfigError) as one:
        _refuse_missing_runs(p, p.layout(tmp_path), "params.yaml", "report", [("quick", "fedavg")])
    assert str(one.value).endswith("train them: dvc repro train@quick-fedavg-0"), one.value
    with pytest.raises(ConfigError, match=re.escape("train them: dvc repro train@quick-fedavg-0 train@quick-fedbn-0 (or several at "
                                                    "once: fedsilo grid --jobs 2, every out-of-date run of the pipeline)")):
        _refuse_missing_runs(p, p.layout(tmp_path), "params.yaml", "report", [("quick", "fedavg"), ("quick", "fedbn")])


def test_the_data_origin_note_names_the_mirrors_only_and_passes_over_a_run_not_written(tmp_path):
    """data_origin_note: the line heading a report names the sources of its runs that were offline mirrors, not a
    download or a folder of one's own; none where no run trained on a mirror; a run without metrics.json is passed
    over (the report's own check names it)."""
    import json

    from fedsilo.report.tables import data_origin_note

    def run(method: str, seed: int, sources: dict) -> None:
        (tmp_path / method / f"seed{seed}").mkdir(parents=True)
        (tmp_path / method / f"seed{seed}" / "metrics.json").write_text(json.dumps({"data_sources": sources}))

    run("fedavg", 0, {"rsna": {"mode": "download", "origin": "download: https://x"}, "mine": {"mode": "local", "origin": "/data/mine"}})
    assert data_origin_note(tmp_path, ["fedavg", "fedbn"], [0, 1]) == ""
    run("fedbn", 0, {"rsna": {"mode": "download", "origin": "download: https://x"}, "openi": {"mode": "mirror", "origin": "offline mirror (seed 0)"}})
    assert data_origin_note(tmp_path, ["fedavg", "fedbn"], [0, 1]).startswith(
        "> **Data: offline mirrors** (openi: offline mirror (seed 0)): images generated here, not the real data.")
