"""Issue 17, items 5, 8 and 9: one-line errors that name the key, row or file at fault (never a traceback); Mac-made
and zipped copies whose hidden files are not images; a report that reads right with one seed."""

from __future__ import annotations

import math
import re

import pytest
import torch
import yaml

from fedsilo.config import ConfigError, parse_params
from tests.conftest import REPO, small_params


def _check_params(tmp_path, raw: dict, capsys) -> str:
    """``fedsilo check-params`` on ``raw``: it must fail with exit code 2 and one line on stderr; returns that line."""
    from fedsilo.cli import main

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert main(["--params", str(path), "check-params"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------- item 5: params
@pytest.mark.parametrize("where, key, text", [
    ("train", "lr", ".inf"),
    ("train", "lr", ".nan"),
    ("train", "rounds", "true"),
    ("train", "batch_size", "yes"),
    ("train", "momentum", "-.inf"),
])
def test_a_non_finite_or_boolean_number_is_refused_naming_its_key(tmp_path, capsys, where, key, text):
    raw = small_params()
    raw["experiments"]["quick"][where][key] = yaml.safe_load(f"v: {text}")["v"]
    err = _check_params(tmp_path, raw, capsys)
    assert f"experiments.quick.{where}.{key}:" in err
    assert ("got a boolean" in err) == (text in ("true", "yes"))


def test_method_and_nested_numbers_are_checked_by_the_same_rule(tmp_path, capsys):
    raw = small_params()
    raw["methods"]["fedprox"] = {"mu": float("inf")}
    assert "methods.fedprox.mu: Input should be a finite number" in _check_params(tmp_path, raw, capsys)
    raw = small_params()
    raw["methods"]["fedprox"] = {"mu": True}
    assert "methods.fedprox.mu: expected a number, got a boolean" in _check_params(tmp_path, raw, capsys)
    raw = small_params()
    raw["datasets"]["chest_xray4"]["percentiles"] = [True, 99.5]  # inside a tuple
    assert "datasets.chest_xray4.percentiles: expected a number" in _check_params(tmp_path, raw, capsys)
    raw = small_params()
    raw["methods"]["fedavg"] = {"decouple": {"sigma": float("nan")}}  # a nested method model
    assert "methods.fedavg.decouple.sigma: Input should be a finite number" in _check_params(tmp_path, raw, capsys)
    raw = small_params()
    raw["experiments"]["quick"]["train"]["nesterov"] = True  # a real boolean stays a boolean (and its own rule holds)
    assert "experiments.quick.train: nesterov: Nesterov momentum needs momentum > 0" in _check_params(tmp_path, raw, capsys)


def test_an_invalid_device_names_the_key_and_the_valid_forms(tmp_path, capsys, monkeypatch):
    from fedsilo.client.data import pick_device
    from fedsilo.config import parse_params

    raw = small_params(device="gpu0")
    err = _check_params(tmp_path, raw, capsys)
    assert "experiments.quick.train.device: 'gpu0' is not a device; use auto, cpu, cuda or cuda:N" in err
    for ok in ("auto", "cpu", "cuda", "cuda:1"):
        assert parse_params(small_params(device=ok)).experiments["quick"].train.device == ok
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^experiments.quick.train.device: 'cuda:1', but PyTorch sees no CUDA device"):
        pick_device("cuda:1", "experiments.quick.train.device")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"sees 1 CUDA device\(s\) \(cuda:0 to cuda:0\)"):
        pick_device("cuda:1")


def test_a_model_too_deep_for_the_image_size_fails_at_check_params_naming_both_keys(tmp_path, capsys):
    from fedsilo.models import build_model

    raw = small_params(model="alexnet_bn")  # the CXR mirror at 32 px
    err = _check_params(tmp_path, raw, capsys)
    assert "experiments.quick.train.model: alexnet_bn needs images of at least 63 px" in err
    assert "datasets.chest_xray4.image_size is 32" in err and "simple_cnn" in err
    raw["datasets"]["chest_xray4"]["image_size"] = 64
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(raw))
    from fedsilo.cli import main

    assert main(["--params", str(path), "check-params"]) == 0
    with pytest.raises(ConfigError, match="alexnet_bn needs images of at least 63 px, these are 32 px"):
        build_model("alexnet_bn", 3, 2, image_size=32)  # data harmonized at another size than params says


def test_check_params_warns_of_a_local_source_folder_missing_on_this_machine(tmp_path, capsys, caplog):
    """`sources.rsna.path` misspelt (wrong case): check-params still passes (the file may be another machine's) but
    says fetch will stop; relative paths are the repository root's (--root), as fetch's stage runs there."""
    from fedsilo.cli import main

    raw = small_params()
    (tmp_path / "mine").mkdir()
    raw["sources"]["rsna"] = {"mode": "local", "path": str(tmp_path / "Mine")}
    raw["sources"]["openi"] = {"mode": "local", "path": "mine"}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    with caplog.at_level("WARNING", logger="fedsilo"):
        assert main(["--root", str(tmp_path), "--params", str(path), "check-params"]) == 0
    err = caplog.text
    assert f"sources.rsna.path: {tmp_path / 'Mine'} does not exist on this machine: `dvc repro` will stop at fetch@rsna" in err
    assert "sources.openi" not in err


@pytest.mark.parametrize("name", ["alexnet_bn", "densenet121", "lenet5", "fedecouple_cnn", "fedecouple_cnn_gray", "resnet10_cifar"])
def test_the_minimum_image_size_table_is_what_the_backbones_take(name):
    import torch

    from fedsilo.config import min_image_size
    from fedsilo.models import MODELS, SIZED

    fixed = None if name in SIZED else MODELS[name](3, 2).eval()  # built once: DenseNet-121 takes a second

    def forward(size: int) -> None:
        net = fixed or MODELS[name](3, 2, image_size=size).eval()
        with torch.no_grad():
            net(torch.zeros(2, 3, size, size))

    need = min_image_size(name)
    forward(need)
    if need > 8:
        with pytest.raises(RuntimeError, match="too small"):
            forward(need - 1)


def test_local_rounds_beyond_rounds_fails_at_check_params(tmp_path, capsys):
    raw = small_params(rounds=3)
    raw["methods"]["fedavg"] = {"local_rounds": 3}
    err = _check_params(tmp_path, raw, capsys)
    assert "methods.fedavg.local_rounds: 3 local rounds leave no federated round in experiments.quick.train.rounds (3)" in err
    raw["methods"]["fedavg"] = {"local_rounds": 2}
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(raw))
    from fedsilo.cli import main

    assert main(["--params", str(path), "check-params"]) == 0


def test_a_missing_params_file_says_to_name_one(tmp_path, capsys, monkeypatch):
    """Run outside the repository (a coordinator's or a site's folder) without --params: the error says where
    params.yaml was looked for and that --params names another."""
    from fedsilo.cli import main

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["check-params"]) == 2
    assert "params.yaml: not found (run from the repository root, or name the params file with --params" in capsys.readouterr().err


def test_check_params_prints_a_methods_parameters_as_a_run_takes_them(tmp_path, capsys):
    from fedsilo.cli import main

    raw = small_params(rounds=3)
    raw["methods"]["pfeddb"] = {"local_rounds": 1, "fusion": "weighted"}
    raw["methods"]["fedprox_strong"] = {"method": "fedprox", "mu": 0.5}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert main(["--params", str(path), "check-params", "--method", "pfeddb", "--method", "fedprox_strong"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("methods.pfeddb: pFedDB (")
    assert "  local_rounds: 1 (set)  E0: Phase-1 rounds of local training" in out
    assert "  fusion: 'weighted' (set)" in out and any(x.startswith("  alpha: 0.5 (default)  weight of the shared") for x in out)
    assert "methods.fedprox_strong (method: fedprox): FedProx (Li et al. 2020, MLSys)." in out and "  mu: 0.5 (set)  proximal coefficient" in out
    assert main(["--params", str(path), "check-params", "--method", "fedbm"]) == 2
    assert "p.yaml: methods.fedbm: not defined (methods: fedavg, fedbn, fedprox, fedprox_strong, pfeddb, single; registered methods: " in capsys.readouterr().err
    # a registered method the file has no entry for: its defaults, and the entry that trains it
    assert main(["--params", str(path), "check-params", "--method", "ditto"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"methods.ditto (not in {path}: `ditto: {{}}` under methods trains it with these defaults): Ditto (")
    assert any(x.startswith("  lam: 0.1 (default)") for x in out)
    # a command's experiment or source typo names the file, the key and the near miss
    for cmd, said in ((["report", "--experiment", "quik"], "p.yaml: experiments.quik: not defined (did you mean 'quick'?)"),
                      (["split", "--experiment", "quik"], "p.yaml: experiments.quik: not defined (did you mean 'quick'?)"),
                      (["fetch", "--source", "chexpret"], "p.yaml: sources.chexpret: not defined (did you mean 'chexpert'?)"),
                      (["train", "--experiment", "quick", "--method", "fedprx", "--seed", "0"], "methods.fedprx: not defined in "
                       f"{path} (did you mean 'fedprox'?)"),
                      # a registered method the file has no entry for: the entry that trains it
                      (["train", "--experiment", "quick", "--method", "ditto", "--seed", "0"], "methods.ditto: not defined in "
                       f"{path}; every method trained needs an entry under methods (`ditto: {{}}`")):
        assert main(["--params", str(path), *cmd]) == 2
        assert said in capsys.readouterr().err, cmd
    # trained without an entry: refused, saying what the entry is and where the registered methods are listed
    raw["pipeline"]["methods"] = [*raw["pipeline"]["methods"], "ditto"]
    err = _check_params(tmp_path, raw, capsys)
    assert "pipeline.methods: 'ditto' is not defined under 'methods'; every method trained needs an entry under methods (`ditto: {}`" in err
    # the registered methods, one line each: what data each learns, whether a site may join a run of it in progress
    from fedsilo.methods.registry import REGISTRY

    assert main(["methods"]) == 0
    listed = capsys.readouterr().out.splitlines()
    rows = {x.split()[0]: x for x in listed[1:len(REGISTRY) + 1]}
    assert set(rows) == set(REGISTRY) and listed[0].split() == ["method", "learns", "mid-run", "summary"]
    assert rows["pfeddil"].split()[1:3] == ["stream", "-"] and rows["fedavg"].split()[1:5] == ["static", "+", "stream", "joinable"]
    assert rows["ditto"].split()[1:3] == ["static", "joinable"] and "Ditto (Li et al. 2021, ICML)" in rows["ditto"]


def test_a_method_that_does_not_fit_a_trained_experiments_data_fails_at_check_params(tmp_path, capsys):
    """What the train stage refuses, check-params refuses first: a static method on a domain_incremental
    experiment of the pipeline, a stream-only one on static clients."""
    raw = small_params(rounds=3)
    raw["experiments"]["stream"] = {"dataset": "chest_xray4", "split": {"protocol": "domain_incremental", "clients": 3}}
    raw["pipeline"]["experiments"] = ["quick", "stream"]
    raw["pipeline"]["splits"]["stream"] = "chest_xray4"
    err = _check_params(tmp_path, raw, capsys)
    assert "methods.single: single does not learn a stream of domain tasks; experiments.stream has a domain_incremental split" in err
    # a two-phase method on the stream: the stream's misfit is what is said, not its local_rounds against the stream's
    # rounds per task (a check of a pair that cannot be trained anyway)
    raw["experiments"]["stream"]["train"] = {**raw["experiments"]["quick"]["train"], "rounds": 1}  # per task
    raw["methods"]["pfeddb"] = {"local_rounds": 2}
    raw["pipeline"]["methods"] = ["pfeddb", "single"]
    err = _check_params(tmp_path, raw, capsys)
    assert "methods.pfeddb: pfeddb does not learn a stream of domain tasks; experiments.stream" in err, err
    del raw["methods"]["pfeddb"]
    raw["pipeline"]["methods"] = ["single", "fedavg", "fedprox", "fedbn"]
    raw["pipeline"]["experiments"] = ["quick"]
    raw["methods"]["pfeddil"] = {}
    raw["pipeline"]["methods"] = ["fedavg", "pfeddil"]
    err = _check_params(tmp_path, raw, capsys)
    assert "methods.pfeddil: pfeddil learns a stream of domain tasks only; experiments.quick has static clients (domain_clients)" in err


def test_a_method_entry_that_fails_for_an_experiments_backbone_names_the_file_and_the_experiment(tmp_path, capsys):
    raw = small_params(rounds=3)
    raw["methods"]["pfeddb"] = {"local_rounds": 1, "phase2_optimizer": {"alexnet_bn": "sgd"}}
    raw["pipeline"]["methods"] = ["pfeddb"]
    err = _check_params(tmp_path, raw, capsys)
    assert ("p.yaml: methods.pfeddb.phase2_optimizer: no entry for the backbone simple_cnn (entries: alexnet_bn) "
            "(resolved for experiments.quick)") in err, err


@pytest.mark.parametrize("key,entry,dotted", [
    ("fedper", {"head_layers": {"simple_cn": 3}}, "methods.fedper.head_layers.simple_cn"),
    ("lgfedavg", {"global_layers": {"simple_cnn": 2, "resnt18": 1}}, "methods.lgfedavg.global_layers.resnt18"),
    ("fedbabu", {"head_layers": {"alexnetbn": 1}}, "methods.fedbabu.head_layers.alexnetbn"),
    ("pfeddb", {"local_rounds": 1, "cut_depth": {"densnet121": 88}}, "methods.pfeddb.cut_depth.densnet121"),
])
def test_a_misspelt_backbone_in_a_per_backbone_value_is_refused_when_params_are_read(key, entry, dotted):
    """A mapping backbone -> value with a name no backbone has: pFedDB took it for a backbone without an entry (its
    70 % default, silently), FedPer and LG-FedAvg failed at the train stage."""
    from fedsilo.methods.registry import method_params

    raw = small_params(rounds=3)
    raw["methods"][key] = entry
    with pytest.raises(ConfigError, match=rf"{re.escape(dotted)}: unknown backbone \(known: simple_cnn, "):
        method_params(parse_params(raw), key)


@pytest.mark.parametrize("key,entry,model,text", [
    ("fedper", {"head_layers": {"alexnet_bn": 3}}, "simple_cnn", "methods.fedper.head_layers: no entry for the backbone simple_cnn"),
    ("fedbabu", {"head_layers": 9}, "simple_cnn", "methods.fedbabu.head_layers: 9 must be below the backbone's 6 layers"),
    ("fdse", {}, "simple_cnn", "methods.fdse: cannot convert unit 'conv1' (Sequential); FDSE here needs a BasicBlock ResNet"),
    ("pfeddr", {}, "vit_tiny", "methods.pfeddr: a backbone whose last module is a linear classifier is needed"),
])
def test_a_partial_sharing_method_that_cannot_be_built_on_the_backbone_fails_at_check_params(tmp_path, capsys, key, entry, model, text):
    """check-params builds each trained method's model and shared part on the meta device, as the train stage does
    first (FDSE's conversion, pFedDR's two BatchNorm sets, a head or a mapping that does not fit)."""
    raw = small_params(rounds=3, model=model)
    raw["methods"][key] = entry
    raw["pipeline"]["methods"] = [key]
    err = _check_params(tmp_path, raw, capsys)
    assert f"p.yaml: {text}" in err and f"[{key} on the backbone {model}, experiments.quick.train.model]" in err, err


def test_every_method_on_every_backbone_is_checked_or_refused_by_name_never_crashes():
    """check-params' backbone check either passes or says why (a ConfigError): no method's model fails to build on
    the meta device with another error (FDSE crashed on resnet32's parameter-free shortcut; FedWON's copy of
    weights could not read a meta tensor)."""
    from fedsilo.config import TrainParams, min_image_size
    from fedsilo.methods.registry import REGISTRY, check_backbone
    from fedsilo.models import MODELS

    for name, cls in REGISTRY.items():
        for model in MODELS:
            algo = cls(cls.params_cls(), TrainParams(model=model, device="cpu"), key=name)
            try:
                check_backbone(algo, model, max(32, min_image_size(model)))
            except ConfigError as err:
                assert f"methods.{name}" in str(err), (name, model, err)


# --------------------------------------------------------------------------- item 5: label files
def _rsna(tmp_path, labels: str, classes: str):
    d = tmp_path / "rsna"
    d.mkdir(parents=True)
    (d / "stage_2_train_labels.csv").write_text("patientId,x,y,width,height,Target\n" + labels)
    (d / "stage_2_detailed_class_info.csv").write_text("patientId,class\n" + classes)
    return d


def test_rsna_target_outside_0_1_and_unknown_classes_name_the_row_and_patient(tmp_path):
    from fedsilo.config import RSNARules
    from fedsilo.data.sources import rsna
    from fedsilo.data.sources.base import LabelFileError

    ok_classes = "p1,Normal\np2,Lung Opacity\n"
    d = _rsna(tmp_path / "a", "p1,,,,,0\np2,1,2,3,4,2\n", ok_classes)
    with pytest.raises(LabelFileError, match=r"stage_2_train_labels.csv: row 3 \(patientId p2\): Target 2 is not one of 0, 1$"):
        rsna.read_records(d, RSNARules())
    d = _rsna(tmp_path / "b", "p1,,,,,0\np2,1,2,3,4,\n", ok_classes)  # a blank Target is not 0 either
    with pytest.raises(LabelFileError, match=r"row 3 \(patientId p2\): Target nan is not one of 0, 1"):
        rsna.read_records(d, RSNARules())
    d = _rsna(tmp_path / "c", "p1,,,,,0\np2,1,2,3,4,1\n", "p1,Normal\np2,Pneumonia\n")
    with pytest.raises(LabelFileError, match=r"stage_2_detailed_class_info.csv: row 3 \(patientId p2\): class 'Pneumonia' is not one of 'Lung Opacity'"):
        rsna.read_records(d, RSNARules())
    df = rsna.read_records(_rsna(tmp_path / "d", "p1,,,,,0\np2,1,2,3,4,1\np2,5,6,7,8,1\n", ok_classes + "p2,Lung Opacity\n"), RSNARules())
    assert dict(zip(df["id"], df["label"])) == {"p1": 0, "p2": 1}


def test_vinbigdata_unknown_class_name_is_an_error_and_case_does_not_matter(tmp_path):
    from fedsilo.config import VinBigDataRules
    from fedsilo.data.sources import vinbigdata
    from fedsilo.data.sources.base import LabelFileError

    def records(rows: str, name: str):
        d = tmp_path / name
        d.mkdir()
        (d / "train.csv").write_text("image_id,class_name,class_id,rad_id,x_min,y_min,x_max,y_max\n" + rows)
        return vinbigdata.read_records(d, VinBigDataRules())

    neg = "a,No finding,14,R1,,,,\na,No finding,14,R2,,,,\n"
    with pytest.raises(LabelFileError, match=r"train.csv: row 4 \(image_id b\): class_name 'No findings' is not a VinDr-CXR finding"):
        records(neg + "b,No findings,14,R1,,,,\n", "typo")
    with pytest.raises(LabelFileError, match=r"row 2 \(image_id a\): class_name nan is not a VinDr-CXR finding"):
        records("a,,14,R1,,,,\n", "blank")
    df = records(neg + "b,no  FINDING,14,R1,,,,\nc,lung opacity,7,R1,1,2,3,4\n", "case")
    assert dict(zip(df["id"], df["label"])) == {"a": 0, "b": 0, "c": 1}


def test_label_errors_show_numbers_as_numbers_not_numpy_reprs(tmp_path):
    import numpy as np
    import pandas as pd

    from fedsilo.config import CheXpertRules
    from fedsilo.data.sources.base import LabelFileError
    from fedsilo.data.sources.benchmark import array_records
    from fedsilo.data.sources.chexpert import OBSERVATIONS, _label_table

    df = pd.DataFrame({"Path": ["p/a.jpg", "p/b.jpg"], "Frontal/Lateral": ["Frontal", "Frontal"],
                       **{c: [1.0, 0.0] for c in OBSERVATIONS}})
    df.loc[1, "Edema"] = 2.0
    with pytest.raises(LabelFileError) as err:
        _label_table(df, tmp_path / "train.csv", CheXpertRules())
    assert "column 'Edema' row 3 (Path p/b.jpg): value 2.0 is not 1/0/-1/blank" in str(err.value) and "np." not in str(err.value)
    df["Edema"] = df["Edema"].astype(object)
    df.loc[1, "Edema"] = "yes"  # a word is not a blank
    with pytest.raises(LabelFileError, match="value 'yes' is not 1/0/-1/blank"):
        _label_table(df, tmp_path / "train.csv", CheXpertRules())
    with pytest.raises(LabelFileError) as err:
        array_records("c.pkl", np.array([0, 12]), "train", "x", original=np.array([0.0, 12.0]))
    assert str(err.value) == "c.pkl: label 12.0 at row 1 is not a digit 0-9"


# --------------------------------------------------------------------------- item 8: Mac-made and zipped copies
APPLEDOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64)  # the header of a ._<name> twin


def _mac_copy(root) -> None:
    """What a Mac leaves in a folder it copied to a non-Mac disk or zipped: a ``._<name>`` twin beside every file, a
    ``.DS_Store`` in every folder, and a ``__MACOSX/`` tree of twins."""
    files = [p for p in root.rglob("*") if p.is_file()]
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (d / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(32))
    for f in files:
        (f.parent / f"._{f.name}").write_bytes(APPLEDOUBLE)
        twin = root / "__MACOSX" / f.relative_to(root).parent / f"._{f.name}"
        twin.parent.mkdir(parents=True, exist_ok=True)
        twin.write_bytes(APPLEDOUBLE)


def _mirror(source: str, out):
    from fedsilo.config import MirrorParams
    from fedsilo.data.mirror import mirror_writer

    out.mkdir(parents=True)
    mirror_writer(source)(out, MirrorParams(per_class=1, image_px=32))
    return out


@pytest.mark.parametrize("source", ["pacs", "office_caltech10", "domainnet", "cinic10", "mnist_m"])
def test_a_mac_copy_reads_as_the_original(tmp_path, source):
    from fedsilo.data.sources import source_module

    read = source_module(source).read_records
    original = read(_mirror(source, tmp_path / "orig"), None)
    copy = _mirror(source, tmp_path / "mac")
    _mac_copy(copy)
    got = read(copy, None)
    assert len(got) == len(original) and not got["path"].str.contains(r"(?:^|/)(?:\._|\.DS_Store|__MACOSX)").any()
    assert got.drop(columns="path").equals(original.drop(columns="path"))


def test_a_mac_copy_of_pacs_harmonizes_without_quarantine_and_a_broken_image_is_named_once(tmp_path):
    import pandas as pd

    from fedsilo.config import BenchmarkDatasetParams
    from fedsilo.data.harmonize import harmonize_benchmark

    raw = tmp_path / "raw"
    _mirror("pacs", raw / "pacs")
    _mac_copy(raw / "pacs")
    strict = BenchmarkDatasetParams(kind="pacs", image_size=16, workers=1, max_quarantine_fraction=0.0)
    card = harmonize_benchmark(strict, raw, tmp_path / "out")
    assert sum(d["quarantined"] for d in card["domains"].values()) == 0 and card["total_images"] == 56
    broken = sorted((raw / "pacs").rglob("photo/dog/[!.]*.jpg"))[0]
    broken.write_bytes(b"not a jpeg")
    loose = strict.model_copy(update={"max_quarantine_fraction": 1.0})
    harmonize_benchmark(loose, raw, tmp_path / "out2")
    q = pd.read_csv(tmp_path / "out2" / "quarantine.csv")
    assert len(q) == 1 and q["error"].iloc[0].count(broken.name) == 1, q["error"].iloc[0]
    assert q["error"].iloc[0] == f"{broken}: cannot identify image file"


def test_decoder_errors_name_the_path_once(tmp_path):
    from fedsilo.data.dicom import dicom_to_uint8
    from fedsilo.data.imageops import ImageDecodeError, read_standard_image

    bad = tmp_path / "x.dcm"
    bad.write_bytes(b"garbage")
    for f, path in ((lambda p: read_standard_image(p, False), bad), (dicom_to_uint8, tmp_path / "missing.dcm"),
                    (lambda p: read_standard_image(p, True), tmp_path / "missing.png")):
        with pytest.raises(ImageDecodeError) as err:
            f(str(path))
        assert str(err.value).count(path.name) == 1, str(err.value)


def test_a_local_folder_of_domainnet_zips_skips_their_appledouble_twins(tmp_path):
    import zipfile

    from fedsilo.data.fetch import _unpack_distributed_zips

    with zipfile.ZipFile(tmp_path / "clipart.zip", "w") as z:
        z.writestr("clipart/bird/a.jpg", b"jpeg")
    (tmp_path / "._clipart.zip").write_bytes(APPLEDOUBLE)
    _unpack_distributed_zips("domainnet", tmp_path)
    assert (tmp_path / "clipart" / "bird" / "a.jpg").exists() and not (tmp_path / "clipart.zip").exists()


# --------------------------------------------------------------------------- item 9: the report
def _runs(root, seeds, auc: bool = False, ensemble: bool = False) -> None:
    """metrics.json / history.json of fedavg and single, two clients, for ``seeds``: just what the report reads."""
    from fedsilo.utils.io import write_json

    for m, up in (("fedavg", 8), ("single", 0)):
        for s in seeds:
            acc = {"A-0": 0.5 + 0.1 * s, "B-0": 0.7}
            per = {c: {"acc": a, **({"auc": a} if auc else {})} for c, a in acc.items()}
            hist = [{"round": r, "train_seconds": 1.0, "bytes_up_total": up * 2, "bytes_down_total": up * 2,
                     "sampled": list(acc), "eval": per, "mean_acc": 0.6} for r in (1, 2)]
            met = {"per_client": per, "clients": list(acc), "client_domains": {"A-0": "A", "B-0": "B"}, "mean_acc": 0.6,
                   "bytes_up_per_round": [up * 2, up * 2], "bytes_down_per_round": [up * 2, up * 2], "model_param_bytes": 8,
                   **({"ensemble_acc": 0.65} if ensemble else {})}
            write_json(root / m / f"seed{s}" / "metrics.json", met)
            (root / m / f"seed{s}" / "history.json").write_text(__import__("json").dumps(hist))
            write_json(root / m / f"seed{s}" / "spectrum.json", {"clients": {"A-0": [1.0, 0.5], "B-0": [1.0, 0.5]}})


def test_with_one_seed_the_report_says_n_1_instead_of_plus_minus_zero(tmp_path):
    import pandas as pd

    from fedsilo.report import build_report

    _runs(tmp_path / "res", [0], auc=True, ensemble=True)
    build_report(tmp_path / "res", "e", ["fedavg", "single"], [0], tmp_path / "out")
    out = tmp_path / "out"
    for name in ("e_accuracy.md", "e_accuracy.tex", "e_local_new_external.md", "e_collapse.md", "README.md"):
        text = (out / name).read_text()
        assert "± 0.0" not in text and "$\\pm$ 0.0" not in text and "± 0.00" not in text, (name, text)
    acc = (out / "e_accuracy.md").read_text()
    assert "test accuracy (%), seed 0 (n = 1, no spread)" in acc and "test AUC (%), seed 0 (n = 1, no spread)" in acc
    assert "| fedavg | 50.0 | 70.0 | 60.0 |" in acc.replace("**", "")
    assert "seed 0 (n = 1, no spread)" in (out / "e_accuracy.tex").read_text()
    flat = pd.read_csv(out / "e_accuracy.csv", index_col=0)
    assert flat["Avg_std"].isna().all() and flat.loc["fedavg", "Avg_mean"] == pytest.approx(60.0)  # an empty cell, not 0
    # two seeds: mean ± sample std (ddof = 1, said in the caption): A 50 / 60 -> 7.1, Avg 60 / 65 -> 3.5
    _runs(tmp_path / "res2", [0, 1])
    build_report(tmp_path / "res2", "e", ["fedavg", "single"], [0, 1], tmp_path / "out2")
    acc = (tmp_path / "out2" / "e_accuracy.md").read_text()
    assert "mean ± sample std (ddof = 1) over 2 seeds [0, 1]" in acc
    assert "| fedavg | 55.0 ± 7.1 | 70.0 ± 0.0 | 62.5 ± 3.5 |" in acc.replace("**", "")


def test_the_two_communication_tables_say_what_each_one_averages(tmp_path):
    from fedsilo.report import build_report

    _runs(tmp_path / "res", [0])
    build_report(tmp_path / "res", "e", ["fedavg", "single"], [0], tmp_path / "out")
    acc = (tmp_path / "out" / "e_accuracy.md").read_text()
    assert "| method | MiB per round, all clients, up + down (mean over all rounds) |" in acc
    assert "averaged over every round of the run (rounds that send nothing included) and over seeds" in acc
    comm = (tmp_path / "out" / "e_communication.md").read_text()
    assert "uploaded MiB per client per federated round (mean over rounds that upload)" in comm
    assert "divided by the clients that took part in that round (the sampled ones), averaged over the rounds that upload" in comm
    assert comm in acc


def test_a_diverging_local_training_stops_with_the_key_to_change():
    """A finite but far too large learning rate (1e30 passes every params check) trains to a non-finite loss: the
    run stops after that epoch with a ConfigError naming train.lr, not 'exit 0' with NaN metrics."""
    from fedsilo.client.local import train_local
    from fedsilo.config import TrainParams
    from tests.tiny import label_skewed_federation, tiny_net

    client = label_skewed_federation(n_clients=1)[0]
    cfg = TrainParams(model="simple_cnn", rounds=1, local_epochs=3, batch_size=8, lr=1e30, device="cpu", count_flops=False)
    with pytest.raises(ConfigError, match=r"train\.lr: local training diverged .* local epoch 1 "):
        train_local(tiny_net(1, 4), client, cfg, torch.Generator().manual_seed(0))
    cfg = TrainParams(model="simple_cnn", rounds=1, local_epochs=1, batch_size=8, lr=0.01, device="cpu", count_flops=False)
    assert math.isfinite(train_local(tiny_net(1, 4), client, cfg, torch.Generator().manual_seed(0)))


def test_help_lists_what_the_params_file_defines_and_bare_fedsilo_shows_the_commands(tmp_path, capsys):
    """Issue 17.10: `fedsilo train --help` listed no valid experiments or methods; bare `fedsilo` complained about an
    argument instead of showing the commands."""
    from fedsilo import cli

    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump(small_params()))
    with pytest.raises(SystemExit) as done:
        cli.main(["train", "--params", str(params), "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "experiments: quick" in out and "methods: fedavg, fedbn, fedprox, single" in out and "seeds: 0" in out
    with pytest.raises(SystemExit):
        cli.main(["--params", str(tmp_path / "absent.yaml"), "harmonize", "--help"])
    assert "absent.yaml not readable here" in capsys.readouterr().out
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "fetch" in err and "train" in err and "check-params" in err
    # every command's help renders (argparse formats help with %: a bare "95 %" in a help text broke `site --help`)
    commands = next(a for a in cli.build_parser([])._actions if a.choices and "train" in a.choices).choices
    actions = {name: next((a.choices for a in p._actions if a.dest == "action"), {}) for name, p in commands.items()}
    assert set(actions["site"]) == {"card", "supernode", "audit", "predict", "evaluate", "onboard"}
    for name in commands:
        for action in ["", *actions[name]]:  # and each action of site / deploy
            with pytest.raises(SystemExit) as done:
                cli.main(["--params", str(params), name, *([action] if action else []), "--help"])
            assert done.value.code == 0, (name, action)
            assert capsys.readouterr().out.startswith("usage: "), (name, action)


def test_output_piped_into_a_reader_that_stops_early_ends_quietly():
    """`fedsilo --version | head -1`, `fedsilo methods | head -1`: the reader closed the pipe and Python printed a
    BrokenPipeError traceback (the README calls any traceback a bug); now the command ends quietly with the status of
    a process SIGPIPE ended."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered, as in a plain shell
    for args in (["--version"], ["methods"]):
        p = subprocess.Popen([sys.executable, "-c", "import sys; from fedsilo.cli import main; sys.exit(main())", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        p.stdout.close()  # the reader gone before the output is written (head -1 once it has its line)
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipeError" not in err, (args, err)


def test_site_and_deploy_actions_take_their_own_options_and_name_a_missing_one(capsys):
    """`fedsilo site evaluate --help` lists evaluate's options, not supernode's or predict's (one flat list of every
    action's options did); a missing required option is named with the action's usage before anything runs; --params
    and --root are kept wherever they stand (before the command, before the action, after it)."""
    from fedsilo import cli

    with pytest.raises(SystemExit):
        cli.main(["site", "evaluate", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: fedsilo site evaluate") and "--dataset" in out and "--bootstrap" in out
    assert "--superlink" not in out and "--images" not in out and "--strategy" not in out
    with pytest.raises(SystemExit):  # an empty value names nothing (--out "" wrote into the current folder)
        cli.main(["deploy", "key", "--out", "", "--name", "site"])
    assert "fedsilo deploy key: error: argument --out: empty; give a value" in capsys.readouterr().err
    for argv, missing in ((["site", "card"], "--experiment"), (["site", "evaluate", "--model", "m.pt"], "--dataset"),
                          (["site", "supernode", "--experiment", "site", "--superlink", "h:9093"], "--root-certificates, --auth-key"),
                          (["site", "onboard", "--experiment", "site"], "--model"), (["deploy", "key", "--out", "k"], "--name"),
                          (["deploy", "app", "--out", "app"], "--federation"), (["deploy", "status"], "--app")):
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        err = capsys.readouterr().err
        assert done.value.code == 2 and f"fedsilo {' '.join(argv[:2])}: error: the following arguments are required: {missing}" in err, argv
    with pytest.raises(SystemExit):
        cli.main(["site"])
    assert "error: the following arguments are required: action" in capsys.readouterr().err
    parse = cli.build_parser(["x"]).parse_args
    for argv in (["--params", "a.yaml", "--root", "r", "site", "card", "--experiment", "e"],
                 ["site", "--params", "a.yaml", "--root", "r", "card", "--experiment", "e"],
                 ["site", "card", "--experiment", "e", "--params", "a.yaml", "--root", "r"]):
        args = parse(argv)
        assert (args.params, args.root, args.action, args.experiment) == ("a.yaml", "r", "card", "e"), argv
    assert parse(["site", "card", "--experiment", "e"]).params == "params.yaml"


def test_a_method_whose_upload_holds_a_private_key_stops_the_run_in_one_line_naming_its_code(mirror_root, tmp_path, capsys, monkeypatch):
    """A method of one's own that uploads what it declares private: the run stops with one line (not a traceback, which
    the README calls a fedsilo bug to report) that names the tensors and says the method's code is at fault."""
    import shutil

    from fedsilo import cli
    from fedsilo.methods.fedbn import FedBN

    root = tmp_path / "proj"
    (root / "data").mkdir(parents=True)
    shutil.copytree(mirror_root / "data" / "harmonized", root / "data" / "harmonized")
    (root / "params.yaml").write_text(yaml.safe_dump(small_params(rounds=1, count_flops=False)))
    args = ["-q", "--root", str(root), "--params", str(root / "params.yaml")]
    assert cli.main([*args, "split", "--experiment", "quick"]) == 0
    monkeypatch.setattr(FedBN, "private_in_round", lambda self, rnd, private: set(private) | {"units.0.0.weight"})
    capsys.readouterr()
    assert cli.main([*args, "train", "--experiment", "quick", "--method", "fedbn", "--seed", "0"]) == 2
    err = capsys.readouterr().err
    assert "fedsilo train: error: fedbn: client " in err and "tried to upload private tensors ['units.0.0.weight']: the method's code is at fault" in err
    assert "Traceback" not in err


def test_a_papers_experiment_named_without_its_params_file_says_which_file_defines_it(tmp_path, capsys, monkeypatch):
    """`fedsilo report --experiment f2dc_office` at the root answered "not defined" alone: the likeliest slip of a
    paper's user is a forgotten --params. The files of the paper pipelines beside the params file that define the name
    are named, the quickstart's first; a near miss still wins (a typo), and a name no file defines gets no hint."""
    from fedsilo import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(small_params()))
    for where in ("pipelines/mine/params.yaml", "pipelines/mine/paper/params.yaml"):
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / where).write_text(yaml.safe_dump({"experiments": {"mine_office": {}}}))
    (tmp_path / "pipelines/broken").mkdir()
    (tmp_path / "pipelines/broken/params.yaml").write_text("experiments: [unclosed\n")  # passed over, not an error
    for argv in (["report", "--experiment", "mine_office"], ["train", "--experiment", "mine_office", "--method", "fedavg", "--seed", "0"]):
        assert cli.main(argv) == 2
        assert ("experiments.mine_office: not defined" in (err := capsys.readouterr().err) and "(defined in "
                "pipelines/mine/params.yaml, pipelines/mine/paper/params.yaml: add --params pipelines/mine/params.yaml)" in err), err
    assert cli.main(["report", "--experiment", "quik"]) == 2
    assert "(did you mean 'quick'?)" in capsys.readouterr().err
    assert cli.main(["report", "--experiment", "nowhere"]) == 2
    assert "experiments.nowhere: not defined\n" in capsys.readouterr().err


def test_root_and_params_do_not_imply_each_other_and_the_messages_say_which_to_add(tmp_path, capsys, monkeypatch):
    """A site's folder with its params.yaml and data/: `--root hospital` alone read ./params.yaml ("not found"), and
    `--params hospital/params.yaml` alone read and wrote data/ here. Each now names the option to add."""
    from fedsilo import cli

    site = tmp_path / "hospital"
    (site / "data").mkdir(parents=True)
    (site / "params.yaml").write_text(yaml.safe_dump(small_params()))
    monkeypatch.chdir(tmp_path)  # no params.yaml, no data/ here
    assert cli.main(["--root", "hospital", "check-params"]) == 2
    assert ("params.yaml: not found" in (err := capsys.readouterr().err) and "--root hospital holds one: add --params "
            "hospital/params.yaml (--root names the folder of data/ and results/, --params the file read" in err), err
    assert cli.main(["--params", "hospital/params.yaml", "check-params"]) == 0
    assert ("fedsilo check-params: warning: --params hospital/params.yaml is in hospital, which holds data/, but --root is "
            "., which does not: data/ and results/ are read and written under --root (add --root hospital)") in capsys.readouterr().err
    assert cli.main(["--params", "hospital/params.yaml", "--root", "hospital", "check-params"]) == 0
    assert "warning: --params" not in capsys.readouterr().err  # both given: nothing to say


def test_version_names_the_commit_the_training_code_hash_and_the_libraries_without_a_params_file(tmp_path, capsys, monkeypatch):
    """`fedsilo --version` (for a bug report): fedsilo's version, the checkout's commit, the hash of the training code
    (the one data/code/train.json holds), Python's and the libraries' versions; it reads no params file."""
    import importlib.metadata as md
    import subprocess

    from fedsilo import cli
    from fedsilo.codehash import train_code_sha256

    monkeypatch.chdir(tmp_path)  # no params.yaml here
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a CI checkout is a git clone
        assert f"; git {head.stdout.strip()}" in out.splitlines()[0]
    assert out.startswith(f"fedsilo {md.version('fedsilo')} (")
    assert f"training code sha256 {train_code_sha256()} " in out
    assert f"torch {md.version('torch')}, " in out and f"dvc {md.version('dvc')}, " in out
    monkeypatch.setattr(cli, "VERSIONED", ("torch", "no-such-library-here"))
    assert "no-such-library-here not installed" in cli.version_text()
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without git (a hospital's pip install): said, no traceback
    assert cli.version_text().splitlines()[0].endswith("; not a git checkout)")


def test_a_run_whose_inputs_are_missing_names_the_stage_that_builds_them(mirror_root, tmp_path, capsys):
    """The train stage names the `dvc repro` target that writes what it lacks: the dataset's harmonize stage, or the
    split stage of the run's own pipeline (a paper's through its dvc.yaml; plain `dvc repro` builds the root's only)."""
    from fedsilo.cli import main

    paper = str(REPO / "pipelines" / "pfeddb" / "params.yaml")
    capsys.readouterr()
    assert main(["--params", paper, "--root", str(tmp_path), "train", "--experiment", "pfeddb_cxr4", "--method", "fedavg", "--seed", "0"]) != 0
    assert "chest_xray4/images.npy: missing; build it first: dvc repro harmonize@chest_xray4" in capsys.readouterr().err
    assert main(["--params", paper, "--root", str(mirror_root), "train", "--experiment", "pfeddb_cxr4", "--method", "fedavg", "--seed", "0"]) != 0
    assert "pfeddb/quickstart/pfeddb_cxr4.json: missing; build it first: dvc repro pipelines/pfeddb/dvc.yaml:split@pfeddb_cxr4" in capsys.readouterr().err


def test_a_split_the_data_cannot_give_names_the_params_file_and_the_whole_key(mirror_root, tmp_path, capsys):
    raw = small_params()
    raw["experiments"]["quick"]["split"]["n_train"] = 10000
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    from fedsilo.cli import main

    capsys.readouterr()
    assert main(["--params", str(path), "--root", str(mirror_root), "split", "--experiment", "quick"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"p\.yaml: experiments\.quick\.split: domain '\w+': \d+ images from \d+ patients cannot give 10000 train", err), err


def test_a_split_naming_a_domain_its_dataset_lacks_fails_at_check_params(tmp_path, capsys):
    """The dataset's domains follow from params where its sources are public (their readers' domains) or tables of
    the user's (their `domain`): a misspelt or missing domain stopped the split stage, after DVC had started."""
    raw = small_params()
    raw["experiments"]["quick"]["split"]["domains"] = ["CheXpert", "OpenI", "RNSA"]
    err = _check_params(tmp_path, raw, capsys)
    assert ("p.yaml: experiments.quick.split.domains: 'RNSA' is not a domain of datasets.chest_xray4 (did you mean 'RSNA'?) "
            "(its domains: CheXpert, OpenI, RSNA, VinBigData)") in err, err
    raw["experiments"]["quick"]["split"] = {"protocol": "holdout_domain", "holdout": "PadChest", "n_train": 24, "n_test": 16}
    assert "experiments.quick.split.holdout: 'PadChest' is not a domain of datasets.chest_xray4" in _check_params(tmp_path, raw, capsys)


def test_the_split_command_says_each_clients_validation_size(mirror_root, tmp_path, capsys):
    """FedBN's protocol draws a validation set per client: the split's lines name it beside train and test."""
    raw = small_params()
    raw["experiments"]["fedbn_val"] = {"dataset": "chest_xray4", "split": {"protocol": "domain_clients", "n_train_of_smallest": 0.4,
                                                                         "n_val_of_smallest": 0.2, "test_fraction": 0.2}}
    raw["pipeline"]["splits"]["fedbn_val"] = "chest_xray4"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    from fedsilo.cli import main

    capsys.readouterr()
    assert main(["-q", "--params", str(path), "--root", str(mirror_root), "split", "--experiment", "fedbn_val"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("fedbn_val ")]
    # and, for a binary task, each side's class counts (the draws keep no class balance)
    side = r"\d+ (train|test) \(0: \d+ / 1: \d+\)"
    assert len(lines) == 4 and all(re.fullmatch(rf"fedbn_val \S+: {side.replace('(train|test)', 'train')} / [1-9]\d* val / "
                                                 rf"{side.replace('(train|test)', 'test')}", x) for x in lines), lines


def test_a_split_made_before_its_settings_were_edited_is_refused_by_train_naming_the_settings(mirror_root, tmp_path, capsys):
    """A stage run by hand after an edit of experiments.<e>.split but before the split was made again would train on
    the old split and record the new settings with it: train refuses, naming each setting and the stage to rerun."""
    from fedsilo.cli import main

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "harmonized").symlink_to(mirror_root / "data" / "harmonized")
    raw = small_params()
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["-q", "--params", str(path), "--root", str(tmp_path), "split", "--experiment", "quick"]) == 0
    was = raw["experiments"]["quick"]["split"]["n_train"]
    raw["experiments"]["quick"]["split"]["n_train"] = was - 2
    path.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert main(["-q", "--params", str(path), "--root", str(tmp_path), "train", "--experiment", "quick", "--method", "fedavg", "--seed", "0"]) == 2
    err = capsys.readouterr().err
    assert f"built with other settings than experiments.quick.split has now (n_train: built with {was}, now {was - 2}); rerun `dvc repro split@quick`" in err
    assert not (tmp_path / "results").exists()


def test_train_help_lists_the_seeds_of_a_papers_params(capsys):
    from fedsilo.cli import main

    with pytest.raises(SystemExit):
        main(["--params", str(REPO / "pipelines" / "pfeddb" / "paper" / "params.yaml"), "train", "--help"])
    out = capsys.readouterr().out
    assert "  seeds: 0, 1, 2, 3, 4\n" in out and "fedsilo check-params --method KEY" in out


def test_a_source_not_fetched_yet_is_named_with_the_command_that_fetches_it(tmp_path, capsys):
    # `dvc repro fetch@<s>` exists only for a source in pipeline.sources; `fedsilo fetch` works for any
    from fedsilo.cli import main

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(small_params()))
    capsys.readouterr()
    assert main(["--params", str(path), "--root", str(tmp_path), "fingerprint", "--dataset", "chest_xray4"]) == 2
    assert "fetch the source first (`fedsilo fetch --source chexpert`, or `dvc repro fetch@chexpert` once it is in pipeline.sources)" in capsys.readouterr().err


def test_a_key_given_twice_in_a_params_file_is_refused_naming_it(tmp_path, capsys):
    """YAML keeps the last of two equal keys without a word (`lam: 0.8, ..., lam: 0.5` trained 0.5): refused."""
    import yaml

    from fedsilo.cli import main

    text = yaml.safe_dump(small_params()).replace("  fedprox:\n    mu: 0.01\n", "  fedprox:\n    mu: 0.01\n    mu: 0.5\n")
    assert "mu: 0.5" in text
    (tmp_path / "p.yaml").write_text(text)
    assert main(["--params", str(tmp_path / "p.yaml"), "check-params"]) == 2
    assert "not valid YAML: key 'mu' given twice in one mapping (first on line" in capsys.readouterr().err


def test_a_bug_is_not_told_as_a_users_error(monkeypatch, capsys, tmp_path):
    """A KeyError from inside a stage (a bug, not a name the user gave: those are ConfigErrors) propagates with its
    traceback, not as `error: <key>`; a user's error stays one line, with where it was raised under -v."""
    from fedsilo import cli

    def broken(args):
        return {}["bytes"]

    monkeypatch.setattr(cli, "_fingerprint", broken)
    with pytest.raises(KeyError, match="bytes"):
        cli.main(["--root", str(tmp_path), "fingerprint", "--dataset", "x"])

    def missing(args):
        raise FileNotFoundError("data/raw/x: missing")

    monkeypatch.setattr(cli, "_fingerprint", missing)
    capsys.readouterr()
    assert cli.main(["--root", str(tmp_path), "fingerprint", "--dataset", "x"]) == 2
    assert capsys.readouterr().err.strip() == "fedsilo fingerprint: error: data/raw/x: missing"
    assert cli.main(["-v", "--root", str(tmp_path), "fingerprint", "--dataset", "x"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "in missing" in err and err.rstrip().endswith("fedsilo fingerprint: error: data/raw/x: missing")
    # the names a user gives that the registries do not hold are params errors, by key
    from fedsilo.config import ConfigError
    from fedsilo.methods import method_class
    from fedsilo.models import build_model

    with pytest.raises(ConfigError, match="unknown method 'fedawg'"):
        method_class("fedawg")
    with pytest.raises(ConfigError, match="unknown model 'resnet9'"):
        build_model("resnet9", 3, 10)


def test_the_readme_names_every_registered_method_in_its_table_and_layout():
    """A method registered is a row of the README's table (what is shared, which model a client is scored with) and a
    word of the Layout's methods/ list: the two places a reader looks a method up."""
    import re

    from fedsilo.methods import REGISTRY
    from tests.conftest import REPO

    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Federated learning"):text.index("\n## Running on Flower")]
    rows = set(re.findall(r"^\| `([a-z0-9_]+)`", section, flags=re.M))
    layout = text[text.index("  methods/  "):text.index("  fl/  ")]
    words = set(re.findall(r"[a-z0-9_]+", layout))
    assert sorted(set(REGISTRY) - rows) == [], "a registered method without a row in README's method table"
    assert sorted(set(REGISTRY) - words) == [], "a registered method missing from README's Layout (methods/)"


def test_params_and_root_hints_are_given_only_where_they_hold(tmp_path, capsys, monkeypatch):
    """The --params / --root hints are not said where they would mislead: no warning when --root holds data/ too (a
    project of its own), no "add --params" for a --params other than the default, nor when --root holds no
    params.yaml."""
    from fedsilo import cli

    site = tmp_path / "hospital"
    (site / "data").mkdir(parents=True)
    (site / "params.yaml").write_text(yaml.safe_dump(small_params()))
    (tmp_path / "data").mkdir()  # the current folder is a project too
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--params", "hospital/params.yaml", "check-params"]) == 0
    assert "warning: --params" not in capsys.readouterr().err
    assert cli.main(["--params", "other.yaml", "--root", "hospital", "check-params"]) == 2
    assert "other.yaml: not found" in (err := capsys.readouterr().err) and "holds one" not in err, err
    (tmp_path / "empty").mkdir()
    assert cli.main(["--root", "empty", "check-params"]) == 2
    assert "params.yaml: not found" in (err := capsys.readouterr().err) and "holds one" not in err, err


def test_version_says_uncommitted_edits_and_names_no_commit_of_another_repository(monkeypatch):
    """`fedsilo --version`: a checkout with edits under src/fedsilo says so beside its commit; a package whose files no
    checkout tracks (installed into site-packages inside some other repository) names no commit, not that
    repository's."""
    import subprocess

    import fedsilo.tracking as tracking
    from fedsilo import cli

    real_run = subprocess.run
    tracked = [0]

    def run(cmd, *a, **k):  # git ls-files --error-unmatch: whether the package's files are a checkout's
        if cmd[:2] == ["git", "ls-files"]:
            return subprocess.CompletedProcess(cmd, tracked[0], b"", b"")
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(tracking, "git_commit", lambda repo: ("0123456789abcdef" * 2, True))
    assert "; git 0123456789ab + uncommitted edits)" in cli.version_text().splitlines()[0]
    tracked[0] = 1
    assert cli.version_text().splitlines()[0].endswith("; not a git checkout)")


def test_a_method_of_ones_own_named_by_report_methods_says_where_it_is_registered(tmp_path, capsys):
    """`report --methods` with a method the params file lacks: a near miss where there is one, else where a method of
    one's own is registered (REGISTER_HINT), never the hint in place of the near miss."""
    from fedsilo.cli import main

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(small_params()))
    base = ["--params", str(path), "--root", str(tmp_path), "report", "--experiment", "quick", "--methods"]
    assert main([*base, "my_method"]) == 2
    assert ("methods.my_method: not defined; a method of your own is known once its class is in REGISTRY of "
            "src/fedsilo/methods/registry.py") in capsys.readouterr().err
    assert main([*base, "fedprx"]) == 2
    assert "methods.fedprx: not defined (did you mean 'fedprox'?)" in (err := capsys.readouterr().err) and "REGISTRY" not in err
