"""`fedsilo site evaluate`: the model a site kept, scored on a labelled dataset the site harmonized itself, with
patient-level bootstrap intervals; refusals where the dataset is not what the model was trained for."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from fedsilo.cli import main as fedsilo
from fedsilo.client.local import binary_auc, predict
from fedsilo.config import ConfigError, parse_params
from fedsilo.data.fetch import fetch
from fedsilo.data.harmonize import harmonize_dataset
from fedsilo.fl.deploy import deployment_spec
from fedsilo.fl.evaluate import evaluate_site_model, patient_bootstrap_auc, wilson
from fedsilo.fl.flower import KeptStores

CLASSES = ["Normal", "Lung Opacity"]


def _site(tmp_path: Path, size: int = 32) -> tuple[dict, Path, torch.nn.Module]:
    """A site holding a labelled external set (a hospital export and RSNA's mirror, one dataset) and a kept model."""
    raw = {
        "sources": {"rsna": {"mode": "mirror", "mirror": {"patients": 20, "image_px": 64}},
                    "st_marys": {"mode": "mirror", "reader": "cxr_table", "mirror": {"patients": 20, "image_px": 64}}},
        "datasets": {"external": {"kind": "chest_xray4", "sources": ["rsna", "st_marys"], "image_size": size, "workers": 1}},
        "experiments": {}, "methods": {},
        "pipeline": {"sources": ["rsna", "st_marys"], "datasets": ["external"], "splits": {}, "experiments": [], "methods": [], "seeds": [0]},
        "tracking": {"enabled": False},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    p = parse_params(raw)
    for s in ("rsna", "st_marys"):
        fetch(s, p.sources[s], tmp_path / "data" / "raw" / s)
    harmonize_dataset(p.datasets["external"], tmp_path / "data" / "raw", tmp_path / "data" / "harmonized" / "external", quiet=True)
    dep = {"name": "three_hospitals", "method": {"key": "fedbn", "base": "fedbn", "params": {}}, "seed": 0,
           "train": {"model": "simple_cnn", "model_width": 0.25, "device": "cpu"},
           "contract": {"task": "binary: 1 = Lung Opacity, 0 = Normal", "classes": CLASSES, "image_shape": [32, 32, 1]}}
    torch.manual_seed(3)
    model = deployment_spec(dep).make_model()
    kept = KeptStores(tmp_path / "state" / "deploy" / "three_hospitals" / "0123456789abcdef", "RSNA")  # as a ClientApp keeps it
    kept.save_model(4, model, {"deployment": dep})
    return raw, kept.model_path, model.eval()


def test_the_kept_model_is_scored_on_every_image_with_its_metrics_per_domain(tmp_path, capsys):
    raw, model_path, model = _site(tmp_path)
    args = ["--params", str(tmp_path / "params.yaml"), "--root", str(tmp_path), "site", "evaluate", "--dataset", "external",
            "--bootstrap", "200"]
    assert fedsilo(args) == 0  # the only model.pt the site keeps
    out = tmp_path / "evaluation" / "external"
    summary = json.loads((out / "evaluation.json").read_text())
    rows = pd.read_csv(out / "predictions.csv")
    assert "| all |" in capsys.readouterr().out and "External validation: external" in (out / "evaluation.md").read_text()

    h = tmp_path / "data" / "harmonized" / "external"
    images = torch.from_numpy(np.load(h / "images.npy")).permute(0, 3, 1, 2).contiguous()
    want = predict(model, images).softmax(1).numpy()
    np.testing.assert_allclose(rows[[f"prob.{c}" for c in CLASSES]].to_numpy(), want, atol=1e-6)
    records = pd.read_parquet(h / "records.parquet")
    assert rows["id"].tolist() == records["id"].tolist() and rows["patient"].tolist() == records["group"].tolist()
    assert summary["round"] == 4 and summary["method"] == "fedbn" and set(summary["domains"]) == {"RSNA", "st_marys"}

    for name, part in [*((d, rows[rows["domain"] == d]) for d in summary["domains"]), ("all", rows)]:
        m = summary["all"] if name == "all" else summary["domains"][name]
        y = (part["label"] == "Lung Opacity").to_numpy().astype(int)
        yhat = (part["predicted"] == "Lung Opacity").to_numpy().astype(int)
        tp, fn = int(((y == 1) & (yhat == 1)).sum()), int(((y == 1) & (yhat == 0)).sum())
        tn, fp = int(((y == 0) & (yhat == 0)).sum()), int(((y == 0) & (yhat == 1)).sum())
        assert m["images"] == len(part) and m["patients"] == part["patient"].nunique()
        assert m["confusion"] == [[tn, fp], [fn, tp]] and m["accuracy"] == pytest.approx((tp + tn) / len(part))
        assert m["sensitivity"] == pytest.approx(tp / (tp + fn)) and m["specificity"] == pytest.approx(tn / (tn + fp))
        assert m["auc"] == pytest.approx(binary_auc(y, part["prob.Lung Opacity"].to_numpy()))
        ci = m["auc_ci"]
        assert ci["samples"] + ci["one_class"] == 200 and 0 <= ci["ci"][0] <= ci["ci"][1] <= 1
        assert m["sensitivity_ci"] == list(wilson(tp, tp + fn))


def test_wilson_and_the_patient_bootstrap():
    lo, hi = wilson(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433) and wilson(0, 0) is None and wilson(0, 5)[0] == 0.0
    rng = np.random.default_rng(1)
    y = np.array([0, 1] * 20)
    p = np.clip(y * 0.3 + rng.random(40) * 0.7, 0, 1)
    patients = np.arange(40)
    one = patient_bootstrap_auc(y, p, patients, 300, seed=2)
    # every patient imaged three times: resampling patients draws the same patients, so the interval is the same;
    # resampling the 120 images as if independent would narrow it
    y3, p3, g3 = np.repeat(y, 3), np.repeat(p, 3), np.repeat(patients, 3)
    assert patient_bootstrap_auc(y3, p3, g3, 300, seed=2)["ci"] == pytest.approx(one["ci"])
    naive = patient_bootstrap_auc(y3, p3, np.arange(120), 300, seed=2)["ci"]
    assert naive[1] - naive[0] < 0.8 * (one["ci"][1] - one["ci"][0])


def test_a_dataset_the_model_was_not_made_for_is_refused_by_key(tmp_path):
    raw, model_path, _ = _site(tmp_path, size=16)
    p = parse_params(raw)
    with pytest.raises(ConfigError, match=r"datasets.external.image_size: the harmonized images are \(16, 16, 1\); the model takes \(32, 32, 1\)"):
        evaluate_site_model(p, "external", model_path, tmp_path)
    with pytest.raises(ConfigError, match=r"datasets.other: not defined"):
        evaluate_site_model(p, "other", model_path, tmp_path)
    with pytest.raises(ConfigError, match=r"--bootstrap: 0"):
        evaluate_site_model(p, "external", model_path, tmp_path, bootstrap=0)
    images = tmp_path / "data" / "harmonized" / "external" / "images.npy"
    arr = np.load(images)
    arr[0, 0, 0, 0] ^= 1
    np.save(images, arr)
    with pytest.raises(ConfigError, match=r"images.npy changed after harmonize wrote card.json"):
        evaluate_site_model(p, "external", model_path, tmp_path)
    images.unlink()
    with pytest.raises(ConfigError, match=r"images.npy: missing; run `fedsilo harmonize --dataset external` first"):
        evaluate_site_model(p, "external", model_path, tmp_path)
    assert not (tmp_path / "evaluation").exists()
