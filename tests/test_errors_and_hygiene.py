"""Issue 17, items 5, 8 and 9: one-line errors that name the key, row or file at fault (never a traceback); Mac-made
and zipped copies whose hidden files are not images; a report that reads right with one seed."""

from __future__ import annotations

import pytest
import yaml

from fedsilo.config import ConfigError
from tests.conftest import small_params


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
    with pytest.raises(ConfigError, match=r"train.device: 'cuda:1', but PyTorch sees no CUDA device"):
        pick_device("cuda:1")
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
