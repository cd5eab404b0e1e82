"""params.yaml -> validated, typed configuration.

Every section is a pydantic model with ``extra="forbid"``: an unknown key or a bad value raises
:class:`ConfigError` whose message names the dotted key (``methods.fedprox.mu``) and what is wrong with it.
Method hyper-parameters are validated by the params class each method registers (see ``fedsilo.methods``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

CXR_SOURCES = ("chexpert", "openi", "rsna", "vinbigdata")


class ConfigError(ValueError):
    """A params.yaml problem; the message names the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- sources (fetch stage)
class MirrorParams(Strict):
    patients: int = Field(80, ge=8, description="patients (or studies) the offline mirror writes")
    seed: int = 0
    image_px: int = Field(160, ge=64, le=1024, description="edge of the generated raw images")


class SourceParams(Strict):
    mode: Literal["mirror", "local"] = "mirror"
    path: Optional[str] = Field(None, description="folder or archive for mode=local")
    mirror: MirrorParams = MirrorParams()

    @model_validator(mode="after")
    def _local_needs_path(self) -> "SourceParams":
        if self.mode == "local" and not self.path:
            raise ValueError("mode 'local' needs 'path' (the folder or archive you already have)")
        return self


# --------------------------------------------------------------------------- harmonize
class CheXpertRules(Strict):
    include_valid: bool = True
    uncertain: Literal["exclude", "positive", "negative"] = "exclude"
    negative_ignore: tuple[str, ...] = ("Support Devices",)


class OpenIRules(Strict):
    mesh_fields: tuple[Literal["major", "automatic"], ...] = ("major",)


class RSNARules(Strict):
    pass


class VinBigDataRules(Strict):
    opacity_rule: Literal["majority", "any"] = "majority"


class CXRDatasetParams(Strict):
    kind: Literal["chest_xray4"] = "chest_xray4"
    sources: tuple[Literal["chexpert", "openi", "rsna", "vinbigdata"], ...] = CXR_SOURCES
    image_size: int = Field(224, ge=8, le=1024)
    square: Literal["crop", "pad"] = "crop"
    intensity: Literal["bit_depth", "percentile"] = "bit_depth"
    percentiles: tuple[float, float] = (0.5, 99.5)
    max_quarantine_fraction: float = Field(0.05, ge=0.0, le=1.0)
    workers: int = Field(0, ge=0, description="decode processes; 0 = all cores")
    chexpert: CheXpertRules = CheXpertRules()
    openi: OpenIRules = OpenIRules()
    rsna: RSNARules = RSNARules()
    vinbigdata: VinBigDataRules = VinBigDataRules()

    @field_validator("percentiles")
    @classmethod
    def _pct(cls, v: tuple[float, float]) -> tuple[float, float]:
        lo, hi = v
        if not (0.0 <= lo < hi <= 100.0):
            raise ValueError("need 0 <= low < high <= 100")
        return v


# --------------------------------------------------------------------------- split
class DomainClientsSplit(Strict):
    protocol: Literal["domain_clients"] = "domain_clients"
    seed: int = Field(0, description="split seed; training seeds vary initialisation and data order only")
    n_train: int = Field(458, ge=1)
    n_test: Optional[int] = Field(None, ge=1, description="default: equal to n_train")
    n_test_per_domain: dict[str, int] = Field(default_factory=dict)
    domains: Optional[tuple[str, ...]] = None


# --------------------------------------------------------------------------- train
class AugmentParams(Strict):
    hflip: bool = False
    crop_pad: int = Field(0, ge=0)


class TrainParams(Strict):
    model: Literal["simple_cnn", "alexnet_bn", "densenet121", "resnet10", "resnet18"] = "simple_cnn"
    rounds: int = Field(300, ge=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    optimizer: Literal["sgd"] = "sgd"
    lr: float = Field(1e-2, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    client_fraction: float = Field(1.0, gt=0, le=1)
    eval_every: int = Field(1, ge=1)
    augment: AugmentParams = AugmentParams()
    device: str = "auto"
    amp: Literal["auto", "off", "bf16"] = Field("auto", description="auto = bf16 autocast on CUDA, off on CPU")
    channels_last: Literal["auto", "on", "off"] = Field("auto", description="auto = on for CUDA convnets")
    compile: bool = Field(False, description="torch.compile the model once per run")
    store_device: Literal["auto", "device", "host"] = Field(
        "auto", description="where client stores live: on the device when they fit, else pinned host memory"
    )


class ExperimentParams(Strict):
    dataset: str
    split: DomainClientsSplit
    train: TrainParams = TrainParams()


# --------------------------------------------------------------------------- pipeline / report
class PipelineParams(Strict):
    sources: tuple[str, ...]
    datasets: tuple[str, ...]
    experiments: tuple[str, ...]
    methods: tuple[str, ...]
    seeds: tuple[int, ...]


class TrackingParams(Strict):
    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"


class Params(Strict):
    sources: dict[str, SourceParams]
    datasets: dict[str, CXRDatasetParams]
    experiments: dict[str, ExperimentParams]
    methods: dict[str, dict[str, Any]]
    pipeline: PipelineParams
    tracking: TrackingParams = TrackingParams()

    @model_validator(mode="after")
    def _cross_refs(self) -> "Params":
        for s in self.sources:
            if s not in CXR_SOURCES:
                raise ValueError(f"sources.{s}: unknown source (known: {', '.join(CXR_SOURCES)})")
        for name, ds in self.datasets.items():
            for s in ds.sources:
                if s not in self.sources:
                    raise ValueError(f"datasets.{name}.sources: '{s}' has no entry under 'sources'")
        for name, ex in self.experiments.items():
            if ex.dataset not in self.datasets:
                raise ValueError(f"experiments.{name}.dataset: '{ex.dataset}' is not under 'datasets'")
        for key, known in (
            ("sources", self.sources),
            ("datasets", self.datasets),
            ("experiments", self.experiments),
            ("methods", self.methods),
        ):
            for item in getattr(self.pipeline, key):
                if item not in known:
                    raise ValueError(f"pipeline.{key}: '{item}' is not defined under '{key}'")
        return self


def _format_validation_error(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        key = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{key}: {msg}")
    return "; ".join(lines)


def parse_params(raw: dict[str, Any], source: str = "params.yaml") -> Params:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        params = Params.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_validation_error(err)}") from None
    # method hyper-parameters are validated by each method's own params class
    from fedsilo.methods import method_params_class

    for name, mp in params.methods.items():
        try:
            cls = method_params_class(name)
        except KeyError as err:
            raise ConfigError(f"{source}: methods.{name}: {err.args[0]}") from None
        try:
            cls.model_validate(mp or {})
        except ValidationError as err:
            raise ConfigError(f"{source}: {_format_validation_error(err, f'methods.{name}.')}") from None
    return params


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: not found (run from the repository root)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return parse_params(raw, str(path))


def method_params(params: Params, name: str) -> BaseModel:
    from fedsilo.methods import method_params_class

    if name not in params.methods:
        raise ConfigError(f"methods.{name}: not defined in params.yaml")
    return method_params_class(name).model_validate(params.methods[name] or {})
