"""The report's communication table (pFedDB Fig. 4 / Table 3) comes from the measured payloads."""

from __future__ import annotations

import shutil

import pandas as pd

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
    made = build_report(root, "quick", list(raw["pipeline"]["methods"]), [0], root / "results" / "report" / "quick",
                        published=raw["experiments"]["quick"]["published"], method_entries=raw["methods"])
    comm = pd.read_csv(root / "results" / "report" / "quick" / "quick_communication.csv", index_col=0)
    model = build_model("simple_cnn", 1, 2, seed=0)
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
    # ours beside the paper's Table 1 (methods both have), with the difference
    vs = pd.read_csv(root / "results" / "report" / "quick" / "quick_vs_paper.csv", index_col=0)
    assert list(vs.index) == ["single", "fedavg", "pfeddb"]
    ours = pd.read_csv(root / "results" / "report" / "quick" / "quick_accuracy.csv", index_col=0)
    assert abs(vs.loc["pfeddb", "OpenI_paper"] - 73.3) < 1e-9 and abs(vs.loc["single", "Avg_paper"] - 80.7) < 1e-9
    assert abs(vs.loc["fedavg", "RSNA_ours"] - ours.loc["fedavg", "RSNA_mean"]) < 1e-3
    assert abs(vs.loc["fedavg", "RSNA_diff"] - (vs.loc["fedavg", "RSNA_ours"] - 84.1)) < 1e-3
    assert "ours / paper" in (root / "results" / "report" / "quick" / "quick_vs_paper.md").read_text()
    for fig in ("quick_fig3_scatter.png", "quick_fig5_two_phase.png"):
        assert (root / "results" / "report" / "quick" / fig).stat().st_size > 1000
