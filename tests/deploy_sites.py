"""Sites of a deployment test: each a folder of its own with a params file naming one chest X-ray source (offline
mirror), harmonized and split by fedsilo's own commands in that folder, as a hospital would."""

from __future__ import annotations

from pathlib import Path

import yaml

from fedsilo.cli import main as fedsilo

SITE_SOURCES = ("chexpert", "rsna", "vinbigdata")


def site_params(source: str, image_size: int = 16, n_train: int = 16, n_test: int = 10, split_seed: int = 0) -> dict:
    return {
        "sources": {source: {"mode": "mirror", "mirror": {"patients": 40}}},
        "datasets": {"chest_xray4": {"sources": [source], "image_size": image_size, "workers": 1}},
        "experiments": {"site": {"dataset": "chest_xray4",
                                 "split": {"protocol": "domain_clients", "seed": split_seed, "n_train": n_train, "n_test": n_test},
                                 "train": {"model": "simple_cnn", "model_width": 0.25, "rounds": 2, "batch_size": 8, "lr": 0.05, "device": "cpu"}}},
        "methods": {"single": {}},
        "pipeline": {"sources": [source], "datasets": ["chest_xray4"], "splits": {"site": "chest_xray4"},
                     "experiments": ["site"], "methods": ["single"], "seeds": [0]},
        "tracking": {"enabled": False},
    }


def make_site(folder: Path, source: str, **kw) -> Path:
    """The site's folder after `fedsilo fetch / harmonize / split` there; returns its params file."""
    folder.mkdir(parents=True, exist_ok=True)
    params = folder / "params.yaml"
    params.write_text(yaml.safe_dump(site_params(source, **kw), sort_keys=False))
    common = ["-q", "--params", str(params), "--root", str(folder)]
    for cmd in (["fetch", "--source", source], ["harmonize", "--dataset", "chest_xray4"], ["split", "--experiment", "site"]):
        assert fedsilo(common + cmd) == 0, cmd
    return params


def make_stream_site(folder: Path, name: str, mirror_seed: int, sources: tuple[str, ...] = ("chexpert", "openi")) -> Path:
    """A hospital whose images come in a stream of domains (here two mirrors, one domain each, drawn with the site's
    own seed): its split is its one client's stream (``domain_incremental``, ``clients: 1``) under its own name."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = site_params(sources[0])
    raw["sources"] = {s: {"mode": "mirror", "mirror": {"patients": 24, "seed": mirror_seed}} for s in sources}
    raw["datasets"]["chest_xray4"]["sources"] = list(sources)
    raw["pipeline"]["sources"] = list(sources)
    raw["experiments"]["site"]["split"] = {"protocol": "domain_incremental", "clients": 1, "names": [name], "alpha": 1.0}
    params = folder / "params.yaml"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    common = ["-q", "--params", str(params), "--root", str(folder)]
    for cmd in ([*(["fetch", "--source", s] for s in sources)], [["harmonize", "--dataset", "chest_xray4"]], [["split", "--experiment", "site"]]):
        for c in cmd:
            assert fedsilo(common + c) == 0, c
    return params
