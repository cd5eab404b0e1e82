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
from fedsilo.fl import evaluate as ev
from fedsilo.fl.deploy import deployment_spec
from fedsilo.fl.evaluate import evaluate_site_model, patient_bootstrap
from fedsilo.fl.flower import KeptStores
from tests.tiny import CPU_TRAIN

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
    dep = {"federation": "three_hospitals", "method": {"key": "fedbn", "base": "fedbn", "params": {}}, "seed": 0,
           "train": {"model": "simple_cnn", "model_width": 0.25, "device": "cpu"},
           "contract": {"task": "binary: 1 = Lung Opacity, 0 = Normal", "classes": CLASSES, "image_shape": [32, 32, 1]}}
    torch.manual_seed(3)
    model = deployment_spec(dep).make_model()
    kept = KeptStores(tmp_path / "state" / "deploy" / "three_hospitals" / "0123456789abcdef", "RSNA")  # as a ClientApp keeps it
    kept.save_model(4, model, {"deployment": dep})
    return raw, kept.model_path, model.eval()


def test_the_kept_model_is_scored_on_every_image_with_its_metrics_per_domain(tmp_path, capsys, monkeypatch):
    raw, model_path, model = _site(tmp_path)
    monkeypatch.setattr(ev, "CHUNK", 16)  # the arrays read a chunk at a time: several chunks here
    out = tmp_path / "reports"
    (out / "other_study.xlsx").parent.mkdir()
    (out / "other_study.xlsx").write_text("kept")
    args = ["--params", str(tmp_path / "params.yaml"), "--root", str(tmp_path), "site", "evaluate", "--dataset", "external",
            "--bootstrap", "200", "--out", str(out)]
    assert fedsilo(args) == 0  # the only model.pt the site keeps
    assert (out / "other_study.xlsx").read_text() == "kept"  # the folder's other files are left alone
    summary = json.loads((out / "evaluation.json").read_text())
    rows = pd.read_csv(out / "predictions.csv")
    md = (out / "evaluation.md").read_text()
    said = capsys.readouterr()
    assert md in said.out and "External validation: external" in md
    assert "evaluate external:" in said.err  # the images scored, as progress (several chunks)

    h = tmp_path / "data" / "harmonized" / "external"
    images = torch.from_numpy(np.load(h / "images.npy")).permute(0, 3, 1, 2).contiguous()
    want = predict(model, images, cfg=CPU_TRAIN).softmax(1).numpy()
    np.testing.assert_allclose(rows[[f"prob.{c}" for c in CLASSES]].to_numpy(), want, atol=1e-6)
    records = pd.read_parquet(h / "records.parquet")
    assert rows["id"].tolist() == records["id"].tolist() and rows["patient"].tolist() == records["group"].tolist()
    assert summary["round"] == 4 and summary["method"] == "fedbn" and set(summary["domains"]) == {"RSNA", "st_marys"}
    assert summary["federation"] == "three_hospitals" and summary["site"] == "RSNA" and "federation three_hospitals" in md

    for name, part in [*((d, rows[rows["domain"] == d]) for d in summary["domains"]), ("all", rows)]:
        m = summary["all"] if name == "all" else summary["domains"][name]
        y = (part["label"] == "Lung Opacity").to_numpy().astype(int)
        yhat = (part["predicted"] == "Lung Opacity").to_numpy().astype(int)
        tp, fn = int(((y == 1) & (yhat == 1)).sum()), int(((y == 1) & (yhat == 0)).sum())
        tn, fp = int(((y == 0) & (yhat == 0)).sum()), int(((y == 0) & (yhat == 1)).sum())
        assert m["images"] == len(part) and m["patients"] == part["patient"].nunique()
        assert m["by_class"] == {"Normal": int((y == 0).sum()), "Lung Opacity": int((y == 1).sum())}
        assert m["confusion"] == [[tn, fp], [fn, tp]] and m["accuracy"] == pytest.approx((tp + tn) / len(part))
        for key, (a, b) in {"sensitivity": (tp, tp + fn), "specificity": (tn, tn + fp), "ppv": (tp, tp + fp), "npv": (tn, tn + fn)}.items():
            assert m[key] == (pytest.approx(a / b) if b else None), key
        assert m["auc"] == pytest.approx(binary_auc(y, part["prob.Lung Opacity"].to_numpy()))
        assert m["bootstrap"]["samples"] == 200
        ci = patient_bootstrap(y, yhat, part["prob.Lung Opacity"].to_numpy(), part["patient"].to_numpy(), 2, 200, seed=0)
        patients = part["patient"].to_numpy()
        for key, boot, among in (("accuracy", "accuracy", y >= 0), ("sensitivity", "recall.1", y == 1), ("specificity", "recall.0", y == 0),
                                 ("ppv", "ppv", yhat == 1), ("npv", "npv", yhat == 0)):
            # the bootstrap's percentiles; at 0 or 100 % (no spread in any sample) the exact interval on the patients
            at_bound = m[key] in (0, 1)
            assert m[f"{key}_ci"] == (ev.exact_at_bound(int(m[key]), len(set(patients[among]))) if at_bound else ci[boot]), key
        assert m["auc_ci"] == ci["auc"]
        for key in ("accuracy", "auc", "sensitivity", "specificity", "ppv", "npv"):
            if m[key] is None:  # no image of its denominator (no positive call: no PPV), nor in any sample
                assert m[f"{key}_ci"] is None, key
                continue
            lo, hi = m[f"{key}_ci"]
            assert 0 <= lo <= hi <= 1, key
        cells = next(line for line in md.splitlines() if line.startswith(f"| {name} |")).split(" | ")
        assert cells[3:5] == [str(m["by_class"]["Normal"]), str(m["by_class"]["Lung Opacity"])]
        shown = {k: "n/a" if m[k] is None else f"{100 * m[k]:.1f}" for k in ("ppv", "npv", "sensitivity", "specificity")}
        assert [c.split(" (")[0] for c in cells[-2:]] == [shown["ppv"], shown["npv"] + (" |" if m["npv"] is None else "")]
        assert m["ppv_ci"] is None or cells[-2].endswith(f"({100 * m['ppv_ci'][0]:.1f}–{100 * m['ppv_ci'][1]:.1f})")
        assert cells[7].split(" (")[0] == shown["sensitivity"] and cells[8].split(" (")[0] == shown["specificity"]
        assert cells[8].endswith(f"({100 * m['specificity_ci'][0]:.1f}–{100 * m['specificity_ci'][1]:.1f})")


def test_the_bootstrap_resamples_patients():
    rng = np.random.default_rng(1)
    y = np.array([0, 1] * 20)
    p = np.clip(y * 0.3 + rng.random(40) * 0.7, 0, 1)
    pred = (p > 0.5).astype(int)
    patients = np.arange(40)
    one = patient_bootstrap(y, pred, p, patients, 2, 300, seed=2)
    # every patient imaged three times: resampling patients draws the same patients, so every interval is the same;
    # resampling the 120 images as if independent would narrow them
    y3, p3, pred3, g3 = np.repeat(y, 3), np.repeat(p, 3), np.repeat(pred, 3), np.repeat(patients, 3)
    three = patient_bootstrap(y3, pred3, p3, g3, 2, 300, seed=2)
    naive = patient_bootstrap(y3, pred3, p3, np.arange(120), 2, 300, seed=2)
    for k in ("accuracy", "auc", "recall.0", "recall.1"):
        assert three[k] == pytest.approx(one[k]), k
        assert naive[k][1] - naive[k][0] < 0.8 * (one[k][1] - one[k][0]), k
    # the weighted rank AUC of a sample is the AUC of its images repeated as drawn
    w = rng.integers(0, 3, size=40).astype(float)
    _, bins = np.unique(p, return_inverse=True)
    idx = np.repeat(np.arange(40), w.astype(int))
    assert ev._weighted_auc(bins, y == 1, w, int(bins.max()) + 1) == pytest.approx(binary_auc(y[idx], p[idx]))
    # with one positive patient (three images) no interval is claimed; with two, the samples that drew no positive
    # patient leave AUC and sensitivity out (counted), and accuracy keeps every sample
    yy = np.array([1, 1, 1] + [0] * 9)
    few = patient_bootstrap(yy, yy, yy * 0.9, np.repeat(np.arange(4), 3), 2, 100)
    assert few["samples"] == 0 and "fewer than 2 patients" in few["why"]
    many = patient_bootstrap(np.r_[yy, 1], np.r_[yy, 0], np.r_[yy * 0.9, 0.2], np.r_[np.repeat(np.arange(4), 3), 9], 2, 200)
    assert many["samples"] == 200 and many["auc"] is not None and many["ppv"] is not None
    assert 200 > many["lacking"]["auc"] >= many["lacking"]["recall.1"] > 0 and "accuracy" not in many["lacking"]


def test_tied_scores_count_one_half_in_the_bootstrap_auc():
    """A model that gives every image one score ranks nothing: AUC 0.5 in every sample, as binary_auc scores it; a
    positive and a negative tied in score count one half (the weighted AUC of unit weights is the plain one)."""
    y = np.array([1] * 6 + [0] * 6)
    ci = patient_bootstrap(y, np.zeros_like(y), np.full(12, 0.4), np.arange(12), 2, 50, seed=0)
    assert binary_auc(y, np.full(12, 0.4)) == 0.5 and ci["auc"] == [0.5, 0.5]
    p, yy = np.array([0.2, 0.5, 0.5, 0.9, 0.5, 0.1]), np.array([0, 1, 0, 1, 1, 0])
    _, bins = np.unique(p, return_inverse=True)
    assert ev._weighted_auc(bins, yy == 1, np.ones(6), int(bins.max()) + 1) == pytest.approx(binary_auc(yy, p))


def test_prevalence_is_part_of_the_uncertainty_and_all_or_none_proportions_get_an_exact_interval():
    """A model that calls every image negative: its accuracy is the share of negatives, which varies between samples
    of patients (a stratified bootstrap would fix it and give a zero-width interval); its sensitivity, 0 of m positive
    patients, gets [0, 1 - 0.025^(1/m)] (Clopper-Pearson), not (0.0-0.0)."""
    y = np.array([1] * 16 + [0] * 21)
    pred = np.zeros_like(y)
    ci = patient_bootstrap(y, pred, np.full(37, 0.4), np.arange(37), 2, 500, seed=0)
    assert ci["accuracy"][1] - ci["accuracy"][0] > 0.2  # 21/37 = 0.57, its binomial interval about 0.40-0.73
    assert ci["recall.1"] == [0.0, 0.0]  # the bootstrap alone: no spread
    assert ev.exact_at_bound(0, 16) == pytest.approx([0.0, 0.2059], abs=1e-4)  # the exact upper bound for 0/16
    assert ev.exact_at_bound(1, 21) == pytest.approx([0.8389, 1.0], abs=1e-4)


def test_patients_alike_give_every_interval_as_a_point_at_its_own_value():
    """Where every patient holds the same images with the same calls, every bootstrap sample is the whole set over
    again: each interval is the point of its own value (PPV over the positive calls, NPV over the negative ones,
    sensitivity and specificity over the true classes, AUC on the probabilities), whichever patients are drawn."""
    y1, pred1, p1 = [1, 1, 0, 0, 0], [1, 0, 1, 1, 0], [0.9, 0.3, 0.8, 0.6, 0.1]
    patients = 6
    y, pred, prob = (np.tile(v, patients) for v in (y1, pred1, p1))
    ci = patient_bootstrap(np.asarray(y), np.asarray(pred), np.asarray(prob, dtype=float), np.repeat(np.arange(patients), 5), 2, 40, seed=3)
    want = {"accuracy": 2 / 5, "recall.1": 1 / 2, "recall.0": 1 / 3, "ppv": 1 / 3, "npv": 1 / 2,
            "auc": binary_auc(np.asarray(y1), np.asarray(p1))}
    for key, value in want.items():
        assert ci[key] == pytest.approx([value, value]), key
    assert ci["samples"] == 40 and ci["lacking"] == {}


def test_the_interval_is_the_central_95_percent_of_the_patient_samples():
    """One image a patient, half of them right: the accuracy's interval spans about +-1.96 binomial standard errors
    (a 95 % interval, not a 90 % one of +-1.64); with a single patient there is nothing to resample, and no
    interval is claimed."""
    n = 400
    y = np.tile([0, 1], n // 2)
    pred = np.r_[y[: n // 2], 1 - y[n // 2:]]  # 200 right, 200 wrong
    ci = patient_bootstrap(y, pred, None, np.arange(n), 2, 4000, seed=0)
    se = (0.5 * 0.5 / n) ** 0.5
    assert ci["accuracy"][1] - ci["accuracy"][0] == pytest.approx(2 * 1.96 * se, rel=0.06)
    assert "auc" not in ci or ci["auc"] is None  # no probabilities, no AUC
    one = patient_bootstrap(np.array([0, 1, 2]), np.array([0, 1, 1]), None, np.zeros(3, dtype=int), 3, 50)
    assert one["samples"] == 0 and one["why"] == "fewer than 2 patients in all"


def test_an_all_or_none_proportion_gets_the_exact_interval_on_its_own_denominators_patients():
    """A model that calls every image negative: sensitivity 0 of the 16 positive patients gets [0, 1 - 0.025^(1/16)]
    (the patients of its denominator, not all 37); specificity 21 of 21 gets [0.025^(1/21), 1]; the bootstrap's
    interval stands for accuracy, which is at neither bound."""
    y = np.array([1] * 16 + [0] * 21)
    rows = pd.DataFrame({"label": y, "predicted_index": np.zeros(37, dtype=int), "group": [f"p{i}" for i in range(37)],
                         "prob.Normal": 0.6, "prob.Lung Opacity": 0.4})
    m = ev._metrics(rows, CLASSES, 200, 0)
    assert m["sensitivity"] == 0.0 and m["sensitivity_ci"] == pytest.approx(ev.exact_at_bound(0, 16))
    assert m["specificity"] == 1.0 and m["specificity_ci"] == pytest.approx(ev.exact_at_bound(1, 21))
    assert m["npv"] == pytest.approx(21 / 37) and m["ppv"] is None and m["ppv_ci"] is None
    boot = patient_bootstrap(y, np.zeros(37, dtype=int), np.full(37, 0.4), rows["group"].to_numpy(), 2, 200, 0)
    assert m["accuracy_ci"] == boot["accuracy"] and m["npv_ci"] == boot["npv"]
    # one positive patient: no bootstrap, and no exact interval either (no interval is claimed at all)
    few = ev._metrics(rows.assign(group=["p0"] * 16 + [f"q{i}" for i in range(21)]), CLASSES, 50, 0)
    assert few["bootstrap"]["samples"] == 0 and few["sensitivity"] == 0.0 and few["sensitivity_ci"] is None
    assert few["specificity_ci"] is None and few["accuracy_ci"] is None


def test_a_ten_class_benchmark_model_gets_accuracy_recall_and_their_intervals(tmp_path):
    from fedsilo.config import parse_params
    from tests.conftest import add_benchmarks, small_params

    raw = add_benchmarks(small_params())
    raw.update(sources={"office_caltech10": raw["sources"]["office_caltech10"]}, datasets={"office": raw["datasets"]["office_caltech10"]},
               experiments={}, pipeline={"sources": ["office_caltech10"], "datasets": ["office"], "splits": {}, "experiments": [],
                                         "methods": [], "seeds": [0]})
    p = parse_params(raw)
    fetch("office_caltech10", p.sources["office_caltech10"], tmp_path / "data/raw/office_caltech10")
    card = harmonize_dataset(p.datasets["office"], tmp_path / "data/raw", tmp_path / "data/harmonized/office", quiet=True)
    classes = list(card["classes"])
    dep = {"federation": "offices", "method": {"key": "fedavg", "base": "fedavg", "params": {}}, "seed": 0,
           "train": {"model": "simple_cnn", "model_width": 0.25, "device": "cpu"},
           "contract": {"task": card["task"], "classes": classes, "image_shape": [16, 16, 3]}}
    kept = KeptStores(tmp_path / "keep", "amazon")
    kept.save_model(1, deployment_spec(dep).make_model(), {"deployment": dep})
    summary, rows = evaluate_site_model(p, "office", kept.model_path, tmp_path, bootstrap=50)
    m = summary["all"]
    assert len(classes) == 10 and "auc" not in m and set(m["recall"]) == set(classes)
    for c in classes:
        mine = rows[rows["label"] == c]
        assert m["recall"][c] == pytest.approx((mine["predicted"] == c).mean() if len(mine) else None)
    assert m["accuracy_ci"] is not None and set(m["recall_ci"]) == set(classes)
    md = ev.evaluation_markdown(summary)
    assert "recall % by class" in md and "AUC" not in md
    # a grayscale model for these RGB images: refused by the dataset's key, naming channels, not the size
    gray = {**dep, "contract": {**dep["contract"], "image_shape": [16, 16, 1]}}
    kept.save_model(1, deployment_spec(gray).make_model(), {"deployment": gray})
    with pytest.raises(ConfigError, match=r"datasets.office: its images have 3 channel\(s\), the model's 1"):
        evaluate_site_model(p, "office", kept.model_path, tmp_path)
    cxr = {**dep, "contract": {"task": "t", "classes": CLASSES, "image_shape": [16, 16, 3]}}
    kept.save_model(1, deployment_spec(cxr).make_model(), {"deployment": cxr})
    with pytest.raises(ConfigError, match=r"datasets.office: its classes .* are not the model's \['Normal', 'Lung Opacity'\]"):
        evaluate_site_model(p, "office", kept.model_path, tmp_path)


def test_a_deployed_sites_model_scored_on_the_split_it_trained_on_is_no_external_validation(tmp_path):
    """The deployment records each site's fingerprint (its harmonized card and split file): a site's kept model scored
    on the dataset whose split is that site's is said to be evaluated on its own training data, by the site's name,
    in the summary and the title; the same dataset under another split file is external."""
    from fedsilo.fl.site import recorded_fingerprint

    raw, model_path, model = _site(tmp_path)
    raw["experiments"] = {"site": {"dataset": "external", "split": {"protocol": "domain_clients", "n_train": 4, "n_test": 4}}}
    p = parse_params(raw)
    split = p.layout(tmp_path).split("site")
    split.parent.mkdir(parents=True, exist_ok=True)
    split.write_text(json.dumps({"clients": {"RSNA": {"train": [0, 1], "test": [2, 3]}}}))
    card = json.loads((tmp_path / "data" / "harmonized" / "external" / "card.json").read_text())
    held = torch.load(model_path, weights_only=False)
    held["deployment"]["sites"] = [{"name": "St Mary's", "fingerprint": "0" * 64},
                                   {"name": "RSNA", "fingerprint": recorded_fingerprint(card, split)}]
    torch.save(held, model_path)
    summary, _ = evaluate_site_model(p, "external", model_path, tmp_path, bootstrap=5)
    assert summary["trained_on"] == "RSNA"
    assert ev.evaluation_markdown(summary).startswith("# Evaluation on the data RSNA trained on (not an external validation): external")
    split.write_text(json.dumps({"clients": {"RSNA": {"train": [0], "test": [2, 3]}}}))  # another split of the same images
    summary, _ = evaluate_site_model(p, "external", model_path, tmp_path, bootstrap=5)
    assert summary["trained_on"] is None and ev.evaluation_markdown(summary).startswith("# External validation: external")


def test_a_dataset_the_model_was_not_made_for_is_refused_by_key(tmp_path):
    raw, model_path, _ = _site(tmp_path, size=16)
    p = parse_params(raw)
    with pytest.raises(ConfigError, match=r"datasets.external.image_size: the harmonized images are 16 px; the model takes 32 px"):
        evaluate_site_model(p, "external", model_path, tmp_path)
    (tmp_path / "big").mkdir()
    big_raw, big_model, _ = _site(tmp_path / "big", size=64)  # larger images than the model's: refused too
    with pytest.raises(ConfigError, match=r"datasets.external.image_size: the harmonized images are 64 px; the model takes 32 px"):
        evaluate_site_model(parse_params(big_raw), "external", big_model, tmp_path / "big")
    with pytest.raises(ConfigError, match=r"datasets.other: not defined"):
        evaluate_site_model(p, "other", model_path, tmp_path)
    with pytest.raises(ConfigError, match=r"--bootstrap: 0"):
        evaluate_site_model(p, "external", model_path, tmp_path, bootstrap=0)
    records = tmp_path / "data" / "harmonized" / "external" / "records.parquet"
    table = pd.read_parquet(records)
    original = records.read_bytes()
    table.assign(label=1 - table["label"]).to_parquet(records, index=False)  # labels flipped after harmonize
    with pytest.raises(ConfigError, match=r"records.parquet changed after harmonize wrote card.json"):
        evaluate_site_model(p, "external", model_path, tmp_path)
    records.write_bytes(original)
    images = tmp_path / "data" / "harmonized" / "external" / "images.npy"
    arr = np.load(images)
    arr[0, 0, 0, 0] ^= 1
    np.save(images, arr)
    with pytest.raises(ConfigError, match=r"images.npy changed after harmonize wrote card.json"):
        evaluate_site_model(p, "external", model_path, tmp_path)
    arr[0, 0, 0, 0] ^= 1  # the images as harmonize wrote them
    np.save(images, arr)
    # the dataset's settings edited and not harmonized again: refused, naming the setting
    edited = parse_params({**raw, "datasets": {**raw["datasets"], "external": {**raw["datasets"]["external"], "image_size": 32}}})
    with pytest.raises(ConfigError, match=r"harmonized with other settings than datasets\.external has now \(image_size: built "
                                          r"with 16, now 32\); rerun `fedsilo harmonize --dataset external`"):
        evaluate_site_model(edited, "external", model_path, tmp_path)
    images.unlink()
    with pytest.raises(ConfigError, match=r"images.npy: missing; run `fedsilo harmonize --dataset external` first"):
        evaluate_site_model(p, "external", model_path, tmp_path)
    assert not (tmp_path / "evaluation").exists()


@pytest.mark.parametrize("method", sorted(m for m in __import__("fedsilo.methods.registry", fromlist=["REGISTRY"]).REGISTRY if m != "pfeddil"))
def test_every_methods_kept_model_is_rebuilt_from_its_file(tmp_path, method):
    """A site keeps the model it was evaluated with as its method built it (pFedDB's two branches, pFedDR's dual
    BatchNorm, FedWon's standardised convolutions, F²DC's modules, ...): `load_site_model` rebuilds each from the file
    alone, with the same outputs. (pFedDIL's sites learn a stream and keep no model.pt.)"""
    from fedsilo.fl.deploy import load_site_model

    train = {"model": "resnet10_cifar"} if method in ("f2dc", "fdse") else {"model": "simple_cnn", "model_width": 0.25}
    dep = {"federation": "f", "method": {"key": method, "base": method, "params": {}}, "seed": 0, "train": {**train, "device": "cpu"},
           "contract": {"task": "t", "classes": CLASSES, "image_shape": [32, 32, 1]}}
    _, model, _ = deployment_spec(dep).build(torch.zeros(2, 1, 32, 32), torch.device("cpu"), [])
    torch.manual_seed(1)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.01)  # a trained model differs from the fresh one the loader builds
    kept = KeptStores(tmp_path, "A")
    kept.save_model(2, model, {"deployment": dep})
    loaded, info = load_site_model(kept.model_path)
    x = torch.rand(3, 1, 32, 32)
    assert info["round"] == 2 and torch.allclose(predict(loaded, (x * 255).to(torch.uint8), cfg=CPU_TRAIN), predict(model.eval(), (x * 255).to(torch.uint8), cfg=CPU_TRAIN))
