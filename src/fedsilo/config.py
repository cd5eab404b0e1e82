"""params.yaml -> validated, typed configuration.

Every section is a pydantic model with ``extra="forbid"``: an unknown key or a bad value raises
:class:`ConfigError` whose message names the dotted key (``methods.fedprox.mu``) and what is wrong with it.
Method hyper-parameters are validated by the params class each method registers (``fedsilo.methods.registry``);
this module does not import the methods.
"""

from __future__ import annotations

import math
import re
import types
import unicodedata
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from fedsilo.layout import Layout

CXR_SOURCES = ("chexpert", "openi", "rsna", "vinbigdata")
CXR_DOMAINS = ("CheXpert", "OpenI", "RSNA", "VinBigData")  # the domains of the four sources, in their order
# readers for a source of the user's own (any name not among SOURCE_MODES), and the fetch modes they offer:
# ``cxr_table``: chest X-ray files plus a label table the user describes (``datasets.<d>.tables.<source>``);
# ``image_folder``: images in one folder per class (``datasets.<d>.folders.<source>``), and ``image_table``: images
# with a label table of their classes (``datasets.<d>.tables.<source>``), for the benchmark kinds
OWN_READERS: dict[str, tuple[str, ...]] = {"cxr_table": ("mirror", "local"), "image_folder": ("mirror", "local"),
                                            "image_table": ("mirror", "local")}
SOURCE_NAME = re.compile(r"[a-z0-9][a-z0-9_]{0,63}")  # a source name is a folder (data/raw/<name>) and a DVC stage key
# a domain names clients and MLflow metric keys: letters (any script's: São Paulo, Clínica Ñ), digits, space . _ -
DOMAIN_NAME = re.compile(r"[^\W_][\w .-]{0,63}")
RESERVED_DOMAINS = frozenset({"Avg", "STD", "Delta", "forgetting", "final"})  # the report tables' columns beside the domains


def loose_name(name: str) -> str:
    """A class or folder name compared loosely: case, spaces, dashes and underscores do not matter, nor Unicode
    normalization (``Tumör`` written composed on one disk and decomposed on a Mac's)."""
    return re.sub(r"[\s_\-]+", "", unicodedata.normalize("NFC", name).lower())


def numbers_as_words(v: Any) -> Any:
    """YAML reads ``[0, 1]`` (or a key ``0:``) as numbers: folder names and table values are words here like any other.
    ``yes`` / ``no`` / ``on`` / ``off`` unquoted are booleans to YAML, whose spelling is lost: refused, asking for quotes."""
    def word(x: Any) -> Any:
        if isinstance(x, bool):
            raise ValueError(f"{x}: YAML reads an unquoted yes / no / on / off / true / false as a boolean; quote the "
                             "value as your folders or table write it ('yes', 'no', 'on', 'off')")
        return str(x) if isinstance(x, (int, float)) else x

    if isinstance(v, dict):
        return {word(k): word(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [word(x) for x in v]
    return v


def table_word(value: Any) -> str:
    """A label-table value as the ``cxr_table`` rules compare it: trimmed and case-blind, and a number by its value
    (``1``, ``1.0`` and ``"1"`` are one word, as a table that went through a spreadsheet or pandas writes them)."""
    text = str(value).strip().casefold()
    try:
        number = float(text)
    except ValueError:
        return text
    if not math.isfinite(number):
        return text
    return str(int(number)) if number.is_integer() else repr(number)


class ConfigError(ValueError):
    """A params.yaml problem; the message names the key."""


def _bool_for_number(annotation: Any, value: Any) -> bool:
    """True when ``value`` puts a boolean where ``annotation`` wants an int or a float, at any depth of tuples,
    lists, dicts and optionals (pydantic's lax mode would read YAML's ``true`` as 1)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _bool_for_number(args[0], value)
    if origin in (Union, types.UnionType):
        if isinstance(value, bool) and bool in args:
            return False
        return any(_bool_for_number(a, value) for a in args if a is not type(None))
    if isinstance(value, bool):
        return annotation in (int, float)
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return bool(args) and any(_bool_for_number(args[0], v) for v in value)
        return any(_bool_for_number(a, v) for a, v in zip(args, value))
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return any(_bool_for_number(args[1], v) for v in value.values())
    return False


class Strict(BaseModel):
    """The base of every params model (the method params too): unknown keys are refused, and a number must be a
    finite number: ``.inf`` / ``.nan`` and booleans (``true``, ``yes``, ``on``) are refused where an int or a float
    is expected, instead of training to NaN or becoming 1."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_number(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, v in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if field is not None and _bool_for_number(field.annotation, v):
                    raise PydanticCustomError(
                        "bool_for_number", "expected a number, got a boolean (YAML reads true/false/yes/no/on/off as booleans)",
                        {"field": name},
                    )
        return data


# --------------------------------------------------------------------------- sources (fetch stage)
# Which fetch modes each source offers (DESIGN §2). ``download`` without an official scriptable address needs
# ``files`` (the address of the user's copy and its checksum).
SOURCE_MODES: dict[str, tuple[str, ...]] = {
    "chexpert": ("mirror", "local", "aimi", "download"),
    "openi": ("mirror", "local", "download"),
    "rsna": ("mirror", "local", "kaggle"),
    "vinbigdata": ("mirror", "local", "kaggle", "physionet"),
    "mnist": ("mirror", "local", "download"),
    "svhn": ("mirror", "local", "download"),
    "usps": ("mirror", "local", "download"),
    "synthdigits": ("mirror", "local", "download"),
    "mnist_m": ("mirror", "local", "download"),
    "office_caltech10": ("mirror", "local", "download"),
    "pacs": ("mirror", "local", "download"),
    "domainnet": ("mirror", "local", "download"),
    "cifar10": ("mirror", "local", "download"),
    "cifar100": ("mirror", "local", "download"),
    "fmnist": ("mirror", "local", "download"),
    "emnist": ("mirror", "local", "download"),
    "cinic10": ("mirror", "local", "download"),  # no published checksum: pin yours under checksums
    "office31": ("mirror", "local", "download"),  # no published checksum: pin yours under checksums
    "chest_xray4_released": ("mirror", "local"),  # the pFedDB authors' pre-processed copy (a Hugging Face dataset)
    # LEAF's FEMNIST JSON: built by LEAF's preprocess.sh from NIST SD19; no pre-processed file is published to download
    "femnist": ("mirror", "local"),
    "kather_crc": ("mirror", "local", "download"),  # Zenodo 1214456: HISTO-FED's public half (12.5 GB)
}
DIGIT_SOURCES = ("mnist", "svhn", "usps", "synthdigits", "mnist_m")
DATASET_SOURCES: dict[str, tuple[str, ...]] = {
    "chest_xray4": CXR_SOURCES,
    "digits5": DIGIT_SOURCES,
    "office_caltech10": ("office_caltech10",),
    "pacs": ("pacs",),
    "domainnet10": ("domainnet",),
    # pFedDIL's task streams, in the paper's task order (MNIST -> EMNIST -> USPS -> SVHN; Amazon -> DSLR -> Webcam)
    "digit10": ("mnist", "emnist", "usps", "svhn"),
    "office31": ("office31",),
    # single-domain datasets (one domain, the dataset's name), used under label-skew splits
    "cifar10": ("cifar10",),
    "cifar100": ("cifar100",),
    "fmnist": ("fmnist",),
    "emnist": ("emnist",),
    "cinic10": ("cinic10",),
    "femnist": ("femnist",),  # one domain; its writers are the natural clients (split.protocol: by_writer)
    "kather_crc": ("kather_crc",),  # two centres' H&E patches, nine tissue classes
    "image_folder": (),  # only sources of your own (reader: image_folder)
}


class MirrorParams(Strict):
    patients: int = Field(80, ge=8, description="CXR sources: patients (or studies) the offline mirror writes")
    per_class: int = Field(12, ge=1, description="benchmark sources: images per domain, class and official subset")
    seed: int = Field(0, ge=0)
    image_px: int = Field(160, ge=32, le=1024, description="edge of the generated raw images (fixed-size digit formats ignore it)")


class RemoteFileParams(Strict):
    url: str
    name: Optional[str] = Field(None, description="file name in the raw folder / cache (default: the address's last part)")
    checksum: Optional[str] = Field(None, description="'sha256:<hex>' (or md5/sha1/sha512)")
    unpack: bool = Field(False, description="unpack this archive into the raw folder")


class SourceParams(Strict):
    mode: Literal["mirror", "local", "download", "kaggle", "physionet", "aimi"] = "mirror"
    reader: Optional[Literal["cxr_table", "image_folder", "image_table"]] = Field(
        None, description="a source of your own (any name): 'cxr_table' = chest X-rays (DICOM, PNG, JPEG) with a label "
        "table, read by the rules under datasets.<dataset>.tables.<source>; 'image_folder' = images in one folder per "
        "class (a benchmark kind's dataset, or kind image_folder), read by datasets.<dataset>.folders.<source>; "
        "'image_table' = images and a label table of their classes, read by datasets.<dataset>.tables.<source>; leave "
        "unset for the named public sources")
    path: Optional[str] = Field(None, description="folder or archive for mode=local")
    files: tuple[RemoteFileParams, ...] = Field((), description="download mode: the files to fetch instead of the official list")
    checksums: dict[str, str] = Field(default_factory=dict, description="file name -> 'sha256:<hex>' pins for files with no published checksum")
    include: tuple[str, ...] = Field((), description="physionet / aimi / download: glob patterns of the files to fetch (default: all)")
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


class ReleasedCXR4Rules(Strict):
    class_folders: dict[str, Literal[0, 1]] = Field(
        default_factory=dict, description="class folder name -> label (1 = Lung Opacity, 0 = Normal) where the name is not recognised"
    )


def check_domain_name(v: str) -> None:
    """Raise when ``v`` cannot name a domain (a client in splits, reports and MLflow metric keys)."""
    if not DOMAIN_NAME.fullmatch(v):
        raise ValueError(f"{v!r}: a domain name is letters (accented ones too), digits, spaces, '.', '_' and '-', "
                         "starting with a letter or digit (it names a client in splits, reports and MLflow metric keys)")
    if v in RESERVED_DOMAINS:
        raise ValueError(f"{v!r} is a column of the report's tables ({', '.join(sorted(RESERVED_DOMAINS))}): choose another name")


def _domain_name(v: str) -> str:
    check_domain_name(v)
    return v


def _inside(v: str, what: str) -> str:
    """``v`` as a path inside the source's folder (relative, no '..'), or the error saying what it is for."""
    parts = v.replace("\\", "/").split("/")
    if v.startswith(("/", "\\")) or (len(v) > 1 and v[1] == ":") or ".." in parts or not v.strip():
        raise ValueError(f"{v!r}: {what}")
    return v


DomainName = Annotated[str, AfterValidator(_domain_name)]  # a domain a source of your own forms (a client's name)


DICOM_MATCH_TAGS = ("AccessionNumber", "StudyInstanceUID", "PatientID", "SeriesInstanceUID", "SOPInstanceUID")


class DicomMatch(Strict):
    """A label table's rows matched to DICOM files by an attribute of their headers instead of a path column: a
    radiology report's finding by its study's accession number, an outcome by the patient's ID. Every DICOM below
    ``folder`` whose header's ``tag`` equals a row's ``column`` cell (trimmed, exactly) is an image of that row."""

    folder: str = Field(..., description="a folder inside the source's folder holding the DICOM files (a PACS export, files "
                        "named anyhow, at any depth; '.' for the source's folder itself)")
    column: str = Field(..., description="column: the ID each row names (an accession number, a study UID, a patient ID)")
    tag: Literal[DICOM_MATCH_TAGS] = Field("AccessionNumber", description="the header attribute the column is matched to: "  # type: ignore[valid-type]
                                           + ", ".join(DICOM_MATCH_TAGS))

    @field_validator("folder")
    @classmethod
    def _folder_inside(cls, v: str) -> str:
        return _inside(v, "a folder inside the source's folder (relative, no '..'; '.' for the source's folder itself), "
                       "so the images are fetched and hashed with the table")


class TableFileRules(Strict):
    """A label table of your own (CSV) in the source's folder and the columns every table reader takes: one row per
    image; values compared trimmed and case-blind, numbers by their value (:func:`table_word`)."""

    file: str = Field("labels.csv", description="the label table (CSV), relative to the source's folder (fetched and hashed with it)")
    sep: str = Field(",", min_length=1, max_length=1, description="the table's column separator (';' for a European spreadsheet's CSV, '\\t' for TSV)")
    encoding: str = Field("utf-8", description="the table's text encoding (a BOM is skipped); e.g. cp1252 or utf-16 for a Windows export")
    domain: Optional[DomainName] = Field(None, description="the domain (client / site name) its images form; default: the source's name")
    path: str = Field("path", description="column: the image file, relative to the source's folder")
    patient: Optional[str] = Field(None, description="column: the patient (a patient's images stay on one side of every split); "
                                   "null: each image its own patient (warned: repeat images of a patient may then land on both sides)")
    subset: Optional[str] = Field(None, description="column: your own partition, train / val / test per image (splits' test_from: auto)")
    dicom_match: Optional[DicomMatch] = Field(None, description="find each row's images by their DICOM header instead of a "
                                              "path column (a report table by AccessionNumber, an outcome table by "
                                              "PatientID); without a patient column, each image's group is its header's PatientID")

    @model_validator(mode="after")
    def _match_or_path(self) -> "TableFileRules":
        if self.dicom_match is not None and "path" in self.model_fields_set:
            raise ValueError("dicom_match: the images are found by their DICOM headers, not by a path column; drop path")
        return self

    @field_validator("file")
    @classmethod
    def _file_inside(cls, v: str) -> str:
        return _inside(v, "the label table is a file inside the source's folder (relative, no '..'), so it is fetched "
                       "and hashed with the images; copy it there")

    @field_validator("encoding")
    @classmethod
    def _codec(cls, v: str) -> str:
        try:
            "x".encode(v)  # a text encoding: base64, zlib, ... are codecs, not encodings (LookupError here)
        except LookupError:
            raise ValueError(f"{v!r} is not a text encoding Python knows (e.g. utf-8, cp1252, latin-1, utf-16)") from None
        return v


class CXRTableRules(TableFileRules):
    """How to read a hospital's own label table (a source with ``reader: cxr_table``): one row per image; each rule
    names a column of the table or the values that map to the task's labels and views (compared case-blind, trimmed)."""

    path: str = Field("path", description="column: the image file, relative to the source's folder (DICOM, PNG or JPEG)")
    label: str = Field("label", description="column: the finding")
    positive: tuple[str, ...] = Field(("Lung Opacity",), min_length=1, description="label values meaning Lung Opacity (label 1)")
    negative: tuple[str, ...] = Field(("Normal", "No Finding"), min_length=1, description="label values meaning Normal (label 0)")
    patient: Optional[str] = Field("patient_id", description="column: the patient (a patient's images stay on one side of "
                                   "every split); null: each image its own patient (warned: repeat images of a patient may then "
                                   "land on both sides)")
    view: Optional[str] = Field("view", description="column: the view position; null: every image is frontal (unless dicom_view)")
    dicom_view: bool = Field(False, description="where the view column is blank, or there is none (view: null), take a DICOM's "
                             "view from its header's View Position (0018,5101); a PNG / JPEG then has no view (excluded)")
    frontal: tuple[str, ...] = Field(("PA", "AP", "frontal", "AP supine", "AP erect"), description="view values of frontal images (kept)")
    lateral: tuple[str, ...] = Field(("LL", "RL", "LAT", "lateral"), description="view values of lateral images (excluded)")

    @field_validator("positive", "negative", "frontal", "lateral", mode="before")
    @classmethod
    def _numbers_as_words(cls, v: Any) -> Any:
        """YAML reads ``positive: [1]`` as a number: a table's 1 / 0 labels are words here like any other."""
        return numbers_as_words(v)

    @model_validator(mode="after")
    def _disjoint(self) -> "CXRTableRules":
        match = self.dicom_match
        if match is not None and match.tag != "SOPInstanceUID":
            if not self.dicom_view:
                raise ValueError(f"dicom_match: a row matched by {match.tag} holds every image of a study or patient, frontal "
                                 "and lateral alike; set dicom_view: true (each DICOM's View Position from its header)")
            if "view" in self.model_fields_set and self.view is not None:
                raise ValueError(f"view: a row matched by {match.tag} holds several images, each with its own view from its "
                                 "DICOM header (dicom_view); set view: null")
        for a, b in (("positive", "negative"), ("frontal", "lateral")):
            both = {table_word(v) for v in getattr(self, a)} & {table_word(v) for v in getattr(self, b)}
            if both:
                raise ValueError(f"{a} and {b} share {', '.join(sorted(both))}")
        return self


class CXRDatasetParams(Strict):
    kind: Literal["chest_xray4"] = "chest_xray4"
    sources: tuple[str, ...] = Field(CXR_SOURCES, description="chexpert, openi, rsna, vinbigdata, or chest_xray4_released "
                                     "without them; beside either, sources of your own with reader: cxr_table")
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
    chest_xray4_released: ReleasedCXR4Rules = ReleasedCXR4Rules()
    tables: dict[str, CXRTableRules] = Field(default_factory=dict, description="per source of your own (reader: cxr_table): "
                                             "how to read its label table (default: CXRTableRules' defaults)")

    @field_validator("sources")
    @classmethod
    def _released_alone(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if "chest_xray4_released" in v and any(s in CXR_SOURCES for s in v):
            raise ValueError("chest_xray4_released holds all four domains: use it without the raw sources (sources of "
                             "your own may join it), or the raw sources without it")
        twice = sorted({s for s in v if v.count(s) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed twice")
        return v

    @model_validator(mode="after")
    def _tables_listed(self) -> "CXRDatasetParams":
        for s in self.tables:
            if s not in self.sources:
                raise ValueError(f"tables.{s}: '{s}' is not among this dataset's sources ({', '.join(self.sources)})")
            if s not in self.own_sources():
                raise ValueError(f"tables.{s}: {s} is a public source read by its own rules (this dataset's '{s}' key); "
                                 "tables are for sources of your own (reader: cxr_table)")
        return self

    def own_sources(self) -> tuple[str, ...]:
        """The sources of the user's own (a label table: ``reader: cxr_table``), in the dataset's order."""
        return tuple(s for s in self.sources if s not in CXR_SOURCES and s != "chest_xray4_released")

    def rules(self, source: str) -> Any:
        """The rules a source's reader takes: a public source's (``chexpert``, ...) or a table's."""
        return self.tables.get(source, CXRTableRules()) if source in self.own_sources() else getattr(self, source)

    def domain_of(self, source: str) -> str:
        """The domain a source of your own forms (its table's ``domain``, default its name), or a public source's."""
        if source in self.own_sources():
            return self.tables.get(source, CXRTableRules()).domain or source
        return CXR_DOMAINS[CXR_SOURCES.index(source)] if source in CXR_SOURCES else "(the four domains)"

    def domains_of(self, source: str) -> tuple[str, ...]:
        """Every domain a source's images form (the released Chest-X-Ray-4: all four)."""
        return CXR_DOMAINS if source == "chest_xray4_released" else (self.domain_of(source),)

    def table_rules_used(self) -> dict[str, Any]:
        """The rules each source of your own was read with (its defaults spelled out), for the data card."""
        return {s: self.rules(s).model_dump(mode="json") for s in self.own_sources()}

    @field_validator("percentiles")
    @classmethod
    def _pct(cls, v: tuple[float, float]) -> tuple[float, float]:
        lo, hi = v
        if not (0.0 <= lo < hi <= 100.0):
            raise ValueError("need 0 <= low < high <= 100")
        return v

    @property
    def source_list(self) -> tuple[str, ...]:
        return tuple(self.sources)


FOLDER_LAYOUTS = ("class", "subset/class", "domain/class", "domain/subset/class")


class RegionRules(Strict):
    """Region annotations of whole-slide images (``fedsilo.data.slides``): polygons drawn on the slides by a
    pathologist, one annotation file per slide (QuPath's GeoJSON export, ASAP's XML as CAMELYON16 ships it, Aperio
    ImageScope's XML, Hamamatsu NDP.view's .ndpa; a DICOM slide's Microscopy Bulk Simple Annotations objects and
    Segmentations), each polygon (or segment) named by its class; a patch takes the class whose regions cover ``min_share`` of it
    or more (where regions overlap, the smaller one: a region drawn inside another, an ASAP exclusion inside a
    tumour, is what lies there)."""

    folder: Optional[str] = Field(None, description="the folder inside the source's folder that holds one annotation file "
                                  "per slide (<slide>.geojson, .json, .xml or .ndpa, named after the slide's file with or without "
                                  "its suffix, or mirroring the slide's folders); null = beside each slide")
    classes: dict[str, str] = Field(default_factory=dict, description="an annotation's class (QuPath's classification, "
                                    "ASAP's PartOfGroup, ImageScope's region Text or layer Name, NDP.view's title) -> the dataset's class, "
                                    "for names that differ (default: the class of the same name, ignoring case only: "
                                    "ASAP's _0 is no class 0)")
    skip: tuple[str, ...] = Field((), description="annotation classes that label nothing: their polygons hide what lies "
                                  "under them (an Ignore region inside a tumour); an annotation with no class (QuPath "
                                  "unclassified, ASAP group None) is not read at all")
    ignore: tuple[str, ...] = Field((), description="annotation classes not read at all: unlike skip they hide nothing (a "
                                    "nucleus segmentation or a tissue outline stored beside the regions)")
    dicom_class: Literal["property_type", "label"] = Field(
        "property_type", description="a DICOM annotation group's or segment's class: property_type = the meaning of its "
        "annotated (segmented) property type (the coded concept, e.g. Neoplasm); label = its free-text label")
    min_share: float = Field(0.5, gt=0, le=1, description="the share of a patch one class's regions must cover for the "
                             "patch to take that class")
    outside: str = Field("slide", description="a patch no class covers by min_share (every patch of a slide without an "
                         "annotation file): slide = it takes the slide's own class (its folder or table row); drop = it is "
                         "not taken (a slide left with none is excluded with the reason); a class name = it takes that "
                         "class (CAMELYON16: normal, its tumours all outlined)")

    @field_validator("folder")
    @classmethod
    def _folder_inside(cls, v: Optional[str]) -> Optional[str]:
        return v if v is None else _inside(v, "a folder inside the source's folder (relative, no '..'), so the annotations "
                                           "are part of the data DVC hashes")

    @field_validator("skip", "ignore", "classes", mode="before")
    @classmethod
    def _numbers(cls, v: Any) -> Any:
        return numbers_as_words(v)

    @model_validator(mode="after")
    def _apart(self) -> "RegionRules":
        fold = lambda name: name.strip().casefold()  # noqa: E731 - as annotation classes are matched
        skip, ignore, mapped = ({fold(n) for n in names} for names in (self.skip, self.ignore, self.classes))
        for a, b, both in (("skip", "ignore", skip & ignore), ("ignore", "classes", ignore & mapped)):
            if both:
                raise ValueError(f"{a} and {b} both name {sorted(both)[0]}: an annotation class is labelled, hidden or not read")
        return self


class SlideRules(Strict):
    """How whole-slide images of your own are cut into patches (``fedsilo.data.slides``): square patches of
    ``patch_px`` pixels at ``mpp`` microns per pixel, where the tissue covers ``min_tissue`` of the patch or more, at
    most ``max_patches`` per slide."""

    mpp: float = Field(0.5, gt=0, description="microns per pixel of a patch (0.5: about 20x; 0.25: about 40x)")
    patch_px: int = Field(224, ge=16, description="a patch's side in pixels at that resolution (the dataset's image_size then resizes it)")
    min_tissue: float = Field(0.5, gt=0, le=1, description="the share of a patch the tissue must cover (found on a thumbnail: saturation above Otsu's threshold)")
    max_patches: int = Field(200, ge=1, description="patches kept per slide at most, evenly spaced over its tissue in reading order")
    slide_mpp: Optional[float] = Field(None, gt=0, description="microns per level-0 pixel for slides whose header does not say (default: a slide without it is excluded, with the reason)")
    focal_plane: Optional[float] = Field(None, description="the focal plane of a DICOM whole-slide image's z-stack "
                                         "read, in um as its header gives it (ZOffsetInSlideCoordinateSystem); null: the middle plane. A "
                                         "slide without that plane is excluded saying which it has; other formats hold one plane")
    optical_path: Optional[str] = Field(None, min_length=1, description="the optical path read of a DICOM whole-slide image with "
                                        "several (a fluorescence channel, ...: its OpticalPathIdentifier); null: the first by identifier. "
                                        "A slide without it is excluded saying which it has")
    regions: Optional[RegionRules] = Field(None, description="label each patch from the slide's region annotations "
                                           "(null: every patch takes its slide's class)")

    @field_validator("optical_path", mode="before")
    @classmethod
    def _path_id(cls, v: Any) -> Any:
        """An identifier written as a number (``optical_path: 2``) is the identifier ``"2"``."""
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class OwnImageRules(Strict):
    """What a reader of your own images does with files that hold more than one picture: a multi-frame DICOM (an
    ultrasound cine, a tomosynthesis series) and a whole-slide image. Each frame or patch is an image of the file's
    class and group, so a file's frames or patches never straddle a split."""

    frames: Union[Literal["first", "all"], Annotated[int, Field(ge=1)]] = Field(
        "first", description="first = the first frame of a multi-frame DICOM only; all = every frame; a number n = up "
        "to n frames evenly spaced from the first to the last (all of them when the file has n or fewer)")
    slides: Optional[SlideRules] = Field(None, description="cut whole-slide images (.svs, .ndpi, .scn, .bif, tiled "
                                         "pyramidal TIFF) into patches; null: a slide is excluded with the reason")

    @field_validator("frames", mode="before")
    @classmethod
    def _frames(cls, v: Any) -> Any:
        """One message for a value that is none of the three forms (not pydantic's per-member union errors)."""
        if isinstance(v, str) and v.strip().lower() in ("first", "all"):
            return v.strip().lower()
        number = v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
        if isinstance(v, str) and v.strip().isdigit():
            number = int(v.strip())
        if number is None or not math.isfinite(number) or number != int(number) or number < 1:
            raise ValueError(f"{v!r} is none of first, all or a number of frames (1 or more)")
        return int(number)


class ImageFolderRules(OwnImageRules):
    """How to read a folder of your own images sorted into one folder per class (a source with ``reader:
    image_folder``), torchvision's ``ImageFolder`` layout and its common variants: below the source's folder an
    optional domain level (several sites in one folder), an optional subset level (your own train / val / test),
    then one folder per class; images may sit at any depth below their class folder (``<class>/<slide>/<patch>``)."""

    layout: Literal["class", "subset/class", "domain/class", "domain/subset/class"] = Field(
        "class", description="the folder levels above the images: class = <class>/<image>; subset/class = "
        "<train|val|test>/<class>/<image>; domain/class and domain/subset/class = one folder per domain (site) first")
    domain: Optional[DomainName] = Field(None, description="the domain (client / site name) the images form; default: the "
                                         "source's name (not with a domain/... layout, whose domain folders name the domains)")
    classes: dict[str, str] = Field(default_factory=dict, description="class folder name -> the dataset's class, for "
                                    "folders named otherwise (default: folder names matched to the classes, ignoring "
                                    "case, spaces, '_' and '-')")
    skip: tuple[str, ...] = Field((), description="class folders left out (each image excluded with the reason, counted in card.md)")
    root: Optional[str] = Field(None, description="the folder inside the source's folder that holds the layout (an "
                                "archive's top-level folder, say); default: the source's folder itself")
    group: Optional[str] = Field(None, description="what keeps images together on one side of every split (a patient, a "
                                 "slide): null = each image its own group (warned); 'folder' = the first folder below the "
                                 "class folder (<class>/<slide>/<patch>); otherwise a regular expression whose one capture "
                                 "group, searched in the file name, is the group (e.g. '^(TCGA-..-....)')")

    @field_validator("group")
    @classmethod
    def _group(cls, v: Optional[str]) -> Optional[str]:
        if v is None or v == "folder":
            return v
        try:
            pattern = re.compile(v)
        except re.error as err:
            raise ValueError(f"{v!r} is not a regular expression ({err}); 'folder' takes the folder below the class folder") from None
        if pattern.groups != 1:
            raise ValueError(f"{v!r} has {pattern.groups} capture groups: it needs exactly one, the part of the file name "
                             "that names the group (e.g. '^(P[0-9]+)_')")
        return v

    @field_validator("classes", "skip", mode="before")
    @classmethod
    def _numbers(cls, v: Any) -> Any:
        return numbers_as_words(v)

    @field_validator("root")
    @classmethod
    def _root_inside(cls, v: Optional[str]) -> Optional[str]:
        return v if v is None else _inside(v, "a folder inside the source's folder (relative, no '..')")

    @model_validator(mode="after")
    def _consistent(self) -> "ImageFolderRules":
        if self.domain is not None and self.layout.startswith("domain/"):
            raise ValueError(f"domain: not with layout {self.layout} (its domain folders name the domains)")
        both = sorted({loose_name(v) for v in self.skip} & {loose_name(v) for v in self.classes})
        if both:
            raise ValueError(f"skip and classes both name {', '.join(both)}")
        return self


class ImageTableRules(TableFileRules, OwnImageRules):
    """How to read a label table of your own for a benchmark kind (a source with ``reader: image_table``): one row per
    image, its class in one column (``label``) or one column per class holding 1 for the row's class (``label_columns``,
    the one-hot layout of ISIC's ground truth). A value is the dataset's class of the same name (case, spaces, '_' and
    '-' aside), or the class ``classes`` maps it to; ``skip`` leaves values out; any other value is an error."""

    path_format: Union[str, tuple[str, ...]] = Field("{}", description="the file a path cell names, '{}' standing for the "
                                                     "cell (e.g. 'ISIC_2019_Training_Input/{}.jpg' for a table of image ids); "
                                                     "several: the first that names a file (HAM10000's two image folders)")
    label: Optional[str] = Field("label", description="column: the row's class (not with label_columns)")
    label_columns: tuple[str, ...] = Field((), description="one column per class, 1 in the row's class and 0 (or blank) "
                                           "elsewhere; a column's name is its class (through classes)")
    classes: dict[str, str] = Field(default_factory=dict, description="label value (or label column) -> the dataset's class, "
                                    "where the names differ")
    skip: tuple[str, ...] = Field((), description="label values (or label columns) left out: their rows excluded with the reason")
    dicom_patient: Optional[str] = Field(None, description="a folder inside the source's folder of DICOM files (a PACS "
                                         "export, files named anyhow, at any depth) matched to the rows by their header's "
                                         "PatientID: the table then has one row per patient (its patient column), whose "
                                         "label every image of the patient takes; the path column is not read")

    @field_validator("skip", "label_columns", "classes", mode="before")
    @classmethod
    def _numbers(cls, v: Any) -> Any:
        return numbers_as_words(v)

    @field_validator("dicom_patient")
    @classmethod
    def _dicom_folder_inside(cls, v: Optional[str]) -> Optional[str]:
        return v if v is None else _inside(v, "a folder inside the source's folder (relative, no '..'; '.' for the source's "
                                           "folder itself), so the images are fetched and hashed with the table")

    @property
    def matched(self) -> Optional[DicomMatch]:
        """How rows find their DICOMs by header: ``dicom_match``, or ``dicom_patient`` (the patient column by PatientID)."""
        if self.dicom_patient is not None and self.patient is not None:
            return DicomMatch(folder=self.dicom_patient, column=self.patient, tag="PatientID")
        return self.dicom_match

    @model_validator(mode="after")
    def _consistent(self) -> "ImageTableRules":
        if self.dicom_patient is not None and self.dicom_match is not None:
            raise ValueError("dicom_patient and dicom_match: dicom_patient is dicom_match by PatientID on the patient "
                             "column; set one")
        if self.dicom_match is not None and "path_format" in self.model_fields_set:
            raise ValueError("dicom_match: the images are found by their DICOM headers, not by a path column; drop path_format")
        if self.dicom_patient is not None and self.patient is None:
            raise ValueError("dicom_patient: needs patient, the column holding the ID the DICOM headers' PatientID is "
                             "matched to")
        if self.dicom_patient is not None and {"path", "path_format"} & self.model_fields_set:
            raise ValueError("dicom_patient: the images are found by their PatientID, not by a path column; drop path "
                             "and path_format")
        for fmt in self.path_formats:
            if fmt.count("{}") != 1 or fmt.replace("{}", "").count("{") or fmt.count("}") != 1:
                raise ValueError(f"path_format: {fmt!r} needs exactly one '{{}}' (where the cell's value goes) and no other braces")
        if not self.path_formats:
            raise ValueError("path_format: an empty list (default '{}': the cell is the path)")
        if self.label_columns and "label" in self.model_fields_set and self.label is not None:
            raise ValueError("label and label_columns: the class is in one column (label) or spread over several "
                             "(label_columns), not both; set label: null")
        if not self.label_columns and self.label is None:
            raise ValueError("label: null needs label_columns (one column per class)")
        if len(set(self.label_columns)) != len(self.label_columns):
            raise ValueError("label_columns: a column listed twice")
        both = sorted({loose_name(table_word(v)) for v in self.skip} & {loose_name(table_word(v)) for v in self.classes})
        if both:
            raise ValueError(f"skip and classes both name {', '.join(both)}")
        return self

    @property
    def path_formats(self) -> tuple[str, ...]:
        return (self.path_format,) if isinstance(self.path_format, str) else tuple(self.path_format)

    @property
    def label_column(self) -> Optional[str]:
        """The one label column, or None when the class is spread over ``label_columns``."""
        return None if self.label_columns else self.label


BENCHMARK_KINDS = ("digits5", "office_caltech10", "pacs", "domainnet10", "digit10", "office31", "kather_crc", "image_folder")


class BenchmarkDatasetParams(Strict):
    """A multi-domain classification benchmark: every image becomes RGB ``image_size`` x ``image_size`` uint8. Beside
    (or, with ``kind: image_folder``, instead of) the kind's public sources, sources of your own with ``reader:
    image_folder`` add domains, their class folders mapped to the dataset's classes (``folders``)."""

    kind: Literal["digits5", "office_caltech10", "pacs", "domainnet10", "digit10", "office31", "kather_crc", "image_folder"]
    sources: Optional[tuple[str, ...]] = Field(None, description="default: every source of the kind; beside them, or "
                                               "alone with kind image_folder, sources of your own with reader: image_folder")
    domains: Optional[tuple[str, ...]] = Field(None, description="keep only these domains (default: all)")
    image_size: int = Field(32, ge=8, le=1024)
    square: Literal["stretch", "crop", "pad"] = Field("stretch", description="stretch resizes directly, as FedBN does")
    max_per_domain: Optional[int] = Field(None, ge=1, description="keep at most this many images per domain and subset (seeded draw)")
    sample_seed: int = Field(0, ge=0)
    max_quarantine_fraction: float = Field(0.05, ge=0.0, le=1.0)
    workers: int = Field(0, ge=0, description="decode processes; 0 = all cores")
    copies: Literal["keep", "group", "exclude"] = Field(
        "keep", description="a public source's files that are byte-identical copies of another of its files (Office-"
        "Caltech-10's Amazon domain holds some): keep them as separate images, as the papers' loaders do (harmonize "
        "warns with the count: an image and its copy may land on both sides of a split); group: each copy joins its "
        "first file's group (same domain and class), so every split keeps them on one side; exclude: keep each image once",
    )
    classes: Optional[tuple[str, ...]] = Field(None, description="kind image_folder: the class list, in label order "
                                               "(default: the class folders' names, sorted, as torchvision's ImageFolder does)")
    folders: dict[str, ImageFolderRules] = Field(default_factory=dict, description="per source of your own (reader: "
                                                 "image_folder): how its folders are laid out (default: ImageFolderRules' defaults)")
    tables: dict[str, ImageTableRules] = Field(default_factory=dict, description="per source of your own with reader: "
                                               "image_table (required for each): how to read its label table")
    _own_allowed: ClassVar[bool] = True  # sources of your own may join (not a single-domain dataset's one domain)

    @field_validator("classes", mode="before")
    @classmethod
    def _numbers(cls, v: Any) -> Any:
        return numbers_as_words(v)

    @model_validator(mode="after")
    def _sources(self) -> "BenchmarkDatasetParams":
        allowed = DATASET_SOURCES[self.kind]
        for s in self.sources or ():
            if s not in allowed and (s in SOURCE_MODES or not self._own_allowed):
                raise ValueError(f"sources: '{s}' is not a source of {self.kind} (its sources: {', '.join(allowed)}"
                                 + (")" if not self._own_allowed else "; or a source of your own with reader: image_folder)"))
        twice = sorted({s for s in self.sources or () if self.sources.count(s) > 1})
        if twice:
            raise ValueError(f"sources: {', '.join(twice)} listed twice")
        if self.kind == "image_folder" and not self.sources:
            raise ValueError("sources: kind image_folder needs your own sources (reader: image_folder) listed")
        if self.classes is not None:
            if self.kind != "image_folder":
                raise ValueError(f"classes: only for kind image_folder ({self.kind}'s classes are its public sources')")
            folded = [loose_name(c) for c in self.classes]
            dup = sorted({c for c, f in zip(self.classes, folded) if folded.count(f) > 1})
            if len(self.classes) < 2 or dup or not all(c.strip() for c in self.classes):
                raise ValueError("classes: two or more distinct, non-blank class names"
                                 + (f" ({', '.join(dup)} listed twice, case, spaces, '_' and '-' aside)" if dup else ""))
            loose = {loose_name(table_word(c)) for c in self.classes}
            for section in ("folders", "tables"):
                for s, rules in getattr(self, section).items():
                    for value, cls in rules.classes.items():
                        if loose_name(table_word(cls)) not in loose:  # as harmonize matches it
                            raise ValueError(f"{section}.{s}.classes.{value}: {cls!r} is not among classes ({', '.join(self.classes)})")
                    regions = rules.slides.regions if getattr(rules, "slides", None) is not None else None
                    if regions is None:
                        continue
                    exact = {c.strip().casefold() for c in self.classes}  # annotation classes: case aside only
                    for value, cls in regions.classes.items():
                        if cls.strip().casefold() not in exact:
                            raise ValueError(f"{section}.{s}.slides.regions.classes.{value}: {cls!r} is not among classes "
                                             f"({', '.join(self.classes)})")
                    if regions.outside not in ("slide", "drop") and regions.outside.strip().casefold() not in exact:
                        raise ValueError(f"{section}.{s}.slides.regions.outside: {regions.outside!r} is none of slide, drop "
                                         f"or a class ({', '.join(self.classes)})")
        for section, reader in (("folders", "image_folder"), ("tables", "image_table")):
            for s in getattr(self, section):
                if s not in self.source_list:
                    raise ValueError(f"{section}.{s}: '{s}' is not among this dataset's sources ({', '.join(self.source_list)})")
                if s not in self.own_sources():
                    raise ValueError(f"{section}.{s}: {s} is a public source with its own layout; {section} are for sources of "
                                     f"your own (reader: {reader})")
        both = sorted(set(self.folders) & set(self.tables))
        if both:
            raise ValueError(f"folders.{both[0]} and tables.{both[0]}: a source is read from its folders or from a table, not both")
        return self

    @property
    def source_list(self) -> tuple[str, ...]:
        return tuple(self.sources or DATASET_SOURCES[self.kind])

    def own_sources(self) -> tuple[str, ...]:
        """The sources of the user's own (``reader: image_folder``), in the dataset's order."""
        return tuple(s for s in self.source_list if s not in DATASET_SOURCES[self.kind])

    def reader_of(self, source: str) -> str:
        """How a source of your own is read: ``image_table`` when ``tables`` holds it (its sources with that reader
        must have an entry), else ``image_folder``."""
        return "image_table" if source in self.tables else "image_folder"

    def rules(self, source: str) -> ImageFolderRules | ImageTableRules:
        return self.tables[source] if source in self.tables else self.folders.get(source, ImageFolderRules())

    def rules_key(self, source: str, name: str) -> str:
        """The dotted params key of a source's rules (``name``: the dataset's key), for messages."""
        return f"datasets.{name or '<dataset>'}.{'tables' if source in self.tables else 'folders'}.{source}"

    def domain_of(self, source: str) -> Optional[str]:
        """The one domain a source of your own forms (its rules' ``domain``, default its name); None when its folders
        name several (a ``domain/...`` layout)."""
        rules = self.rules(source)
        if isinstance(rules, ImageFolderRules) and rules.layout.startswith("domain/"):
            return None
        return rules.domain or source


SINGLE_DOMAIN_KINDS = ("cifar10", "cifar100", "fmnist", "emnist", "cinic10", "femnist")


class SingleDomainDatasetParams(BenchmarkDatasetParams):
    """A single-domain classification dataset (CIFAR-10/100, Fashion-MNIST, EMNIST ByClass, CINIC-10, FEMNIST): one domain
    named after the dataset, the distribution's train / test (/ val) kept in ``subset``, split by label skew. Images
    become ``image_size`` x ``image_size`` uint8 with the data's own channels (grey Fashion-MNIST and EMNIST: 1;
    CIFAR and CINIC-10: 3), or grey replicated to three with ``channels: rgb``."""

    kind: Literal["cifar10", "cifar100", "fmnist", "emnist", "cinic10", "femnist"]
    channels: Literal["native", "rgb"] = Field("native", description="native keeps the data's channels; rgb replicates grey to three")
    _own_allowed: ClassVar[bool] = False  # one public domain: its sources, folders and tables refused by the checks above


# --------------------------------------------------------------------------- split
TestFrom = Literal["auto", "official", "pooled"]


class DomainClientsSplit(Strict):
    protocol: Literal["domain_clients"] = "domain_clients"
    seed: int = Field(0, ge=0, description="split seed; training seeds vary initialisation and data order only")
    n_train: int = Field(458, ge=1)
    n_val: int = Field(0, ge=0, description="validation images per client, drawn from the training pool apart from n_train "
                       "(FedBN's protocol: 0.4 x the smallest domain); scored every evaluated round for best-validation selection")
    n_test: Optional[Union[Annotated[int, Field(ge=1)], Literal["all"]]] = Field(
        None, description="test images per client (default: equal to n_train); 'all': the domain's whole official test "
        "subset (FedBN's test.pkl, a release's test folders)",
    )
    n_test_per_domain: dict[str, int] = Field(default_factory=dict)
    domains: Optional[tuple[str, ...]] = None
    test_from: TestFrom = Field("auto", description="official: the dataset's own test subset; pooled: drawn from all images; auto: official when the domain has one")
    n_train_of_smallest: Optional[float] = Field(
        None, gt=0, le=1, description="FedBN's Office / DomainNet protocol (its loaders, and pFedDB's code after it): every "
        "client trains on floor(f x m) images, m the smallest domain's training pool; replaces n_train",
    )
    n_val_of_smallest: Optional[float] = Field(None, ge=0, lt=1, description="with n_train_of_smallest: floor(f x m) validation images per client; replaces n_val")
    test_fraction: Optional[float] = Field(
        None, gt=0, lt=1, description="with n_train_of_smallest, for a domain with no official test subset (FedBN's "
        "<site>_test.pkl lists): the share of its images held out as its test set; with one, the whole subset is the test set",
    )

    @model_validator(mode="after")
    def _fedbn_sizes(self) -> "DomainClientsSplit":
        if self.n_train_of_smallest is None:
            for key in ("n_val_of_smallest", "test_fraction"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} is set without n_train_of_smallest (FedBN's sizes)")
            return self
        for key in ("n_train", "n_val", "n_test", "n_test_per_domain"):
            if key in self.model_fields_set:
                raise ValueError(f"{key}: not with n_train_of_smallest (FedBN's sizes come from the smallest domain; the "
                                 "test set is the official subset, or test_fraction of a domain without one)")
        return self


class DomainMultiClientsSplit(Strict):
    """F2DC: several clients per domain, each holding ``fraction`` of its domain's training pool (disjoint, but for the
    images ``every_class`` swaps in)."""

    protocol: Literal["domain_multi_clients"]
    seed: int = Field(0, ge=0)
    clients_per_domain: dict[str, int]
    fraction: float = Field(..., gt=0, le=1, description="share of the domain's training pool each client holds")
    n_test: Optional[int] = Field(None, ge=1, description="test images per domain (default: the whole test pool), shared by that domain's clients")
    test_from: TestFrom = "auto"
    test_fraction: float = Field(0.2, gt=0, lt=1, description="pooled test: share of a domain kept as its test pool")
    test_select: Literal["seeded", "listing"] = Field(
        "seeded", description="pooled test: a seeded draw of test_fraction of the domain's images, or 'listing', the F²DC "
        "code's rule: the domain's images in the order torchvision's ImageFolder lists them (class folder, then file), "
        "position i a test image when i mod 10 >= 10 (1 - test_fraction) (test_fraction a multiple of 0.1)",
    )
    every_class: bool = Field(
        False, description="each client holds every class of its domain's training pool: for a class its draw missed, "
        "one image of that class from the pool is swapped in for an image of a class it holds twice or more (the F²DC "
        "code's partition; as there, the image may be one another client of the domain already holds)",
    )

    @model_validator(mode="after")
    def _listing(self) -> "DomainMultiClientsSplit":
        if self.test_select == "listing":
            if self.test_from != "pooled":  # auto would take a domain's official test subset and pass the rule over
                raise ValueError(f"test_select: listing picks the test set from all of a domain's images; set test_from: "
                                 f"pooled (not {self.test_from})")
            if self.n_test is not None:  # the first n_test of the listing would be the first classes only
                raise ValueError("test_select: listing keeps every listed test image (the code's rule); leave n_test out")
            if abs(self.test_fraction * 10 - round(self.test_fraction * 10)) > 1e-9:
                raise ValueError(f"test_select: listing takes whole tenths of the listing (i mod 10); test_fraction "
                                 f"{self.test_fraction} is not a multiple of 0.1")
        return self


class LabelSkewSplit(Strict):
    """Label skew over the pooled images of ``domains`` (default all): Dirichlet(beta) per class, pathological
    (``classes_per_client`` distinct classes each), shards (FedAvg's / LG-FedAvg's label shards: at most
    ``classes_per_client`` classes each), or weak pathological (``s`` % uniform over all classes, the rest from the
    dominant classes). Each client's data is then split into train and test with the same class mix; weak pathological
    draws the two sides separately with the mixture (``samples_per_client`` x ``test_fraction`` test images), and so
    does dirichlet given ``samples_per_client`` (every client that many images, its class shares drawn from
    Dir(beta) over the classes: FedLab's balanced Dirichlet, FedeCouple's Table VI). With
    ``test_from: official`` the scheme deals the official training subset and each client's test side comes from the
    official test subset with its classes (FedPAC's and LG-FedAvg's code)."""

    protocol: Literal["label_skew"]
    seed: int = Field(0, ge=0)
    clients: int = Field(..., ge=2)
    scheme: Literal["dirichlet", "pathological", "shards", "weak_pathological"]
    beta: float = Field(0.5, gt=0)
    classes_per_client: int = Field(2, ge=1, description="pathological: distinct classes a client; shards: shards a client "
                                    "(clients x classes_per_client a multiple of the classes); weak pathological: dominant classes")
    test_from: Literal["pooled", "official"] = Field(
        "pooled", description="pooled: each client's test side drawn from its own share of all images (test_fraction; "
        "PFLlib's rule); official: its training side from the official training subset and its test side from the "
        "official test subset, with its classes (pathological, shards: the same holders deal the test subset; weak "
        "pathological, and dirichlet with samples_per_client: the test draw of the client's class shares)",
    )
    s: float = Field(20.0, ge=0, le=100, description="weak pathological: percent drawn uniformly from all classes")
    samples_per_client: Optional[int] = Field(None, ge=1, description="weak pathological: images per client (default: "
                                              "equal shares); dirichlet: images per client, each client's class shares "
                                              "~ Dir(beta) (default: per class shares over the clients, sizes unequal)")
    dominant_groups: Optional[tuple[tuple[int, ...], ...]] = Field(
        None, description="weak pathological: client j's dominant classes are group j mod len(groups) instead of a random "
        "draw (FedPAC's and FedeCouple's code: [[0,1,2],[2,3,4],[4,5,6],[6,7,8],[8,9,0]] on 10 classes)",
    )
    min_per_client: int = Field(10, ge=1, description="dirichlet without samples_per_client: redraw until every client "
                                "has at least this many images")
    balance: bool = Field(
        False, description="dirichlet: NIID-Bench's / PFLlib's rule, a client holding its equal share of the pool gets "
        "nothing of the classes dealt after (lets beta = 0.01 give 20 clients images on 10 classes)",
    )
    domains: Optional[tuple[str, ...]] = None
    test_fraction: float = Field(0.25, gt=0, lt=1, description="pooled: each client's test share; weak pathological "
                                 "and sized dirichlet (pooled or official): the test draw's share of samples_per_client")

    @model_validator(mode="after")
    def _official_test(self) -> "LabelSkewSplit":
        if self.scheme == "dirichlet" and self.samples_per_client is not None and self.balance:
            raise ValueError("balance: NIID-Bench's rule deals each class's shares over the clients; with "
                             "samples_per_client every client holds that many images already: leave balance out")
        if self.test_from == "official" and self.scheme == "dirichlet" and self.samples_per_client is None:
            # no rule says how per-class shares over the clients meet the test subset
            raise ValueError("test_from: official deals the test subset to a pathological, shards, weak pathological or "
                             "sized dirichlet split's classes; dirichlet without samples_per_client pools the images and "
                             "keeps test_fraction of each client's (PFLlib's practical split): leave test_from out, or set "
                             "samples_per_client (each client's test draw then follows its class shares)")
        if self.test_from == "official" and self.scheme == "weak_pathological" and self.samples_per_client is None:
            # an equal share of one subset would ask the other, smaller one for more than it holds
            raise ValueError("samples_per_client: weak pathological with test_from: official draws samples_per_client x "
                             "(1 - test_fraction) training and samples_per_client x test_fraction test images a client "
                             "from the two subsets; set it (FedPAC's protocol: 900 with test_fraction 1/3)")
        return self

    def dump(self) -> dict[str, Any]:
        """The params as the split file records them: ``test_from`` only where set to ``official``, so a pooled split
        made before the key existed stays byte for byte (its training stages are not rerun)."""
        return self.model_dump(mode="json", exclude={"test_from"} if self.test_from == "pooled" else None)


class DomainIncrementalSplit(Strict):
    """pFedDIL: every client sees the same sequence of domain tasks; within each domain the images are spread over the
    clients with Dirichlet(alpha) label skew (the same alpha for every domain). One order for all clients, as the
    paper's tables print one stream (A -> B -> C); its Fig. 1 caption has each client receive the domains in a random
    order without replacement, which one shared task index per round (the engine's) cannot express."""

    protocol: Literal["domain_incremental"]
    seed: int = Field(0, ge=0)
    clients: int = Field(..., ge=1, description="clients learning the stream (1: a hospital's own stream, a deployment site)")
    names: Optional[tuple[str, ...]] = Field(
        None, description="the clients' names, one per client (default client00, client01, ...): a deployment site's "
        "one-client stream carries its hospital's name"
    )
    alpha: float = Field(1.0, gt=0)
    domain_order: Optional[tuple[str, ...]] = Field(None, description="task order (default: the dataset's domain order)")
    n_per_domain: Optional[int] = Field(None, ge=1, description="cap on a domain's pooled images before spreading")
    test_from: TestFrom = "auto"
    test_fraction: float = Field(0.25, gt=0, lt=1)
    min_per_client: int = Field(2, ge=1)

    @field_validator("domain_order")
    @classmethod
    def _each_domain_once(cls, v: Optional[tuple[str, ...]]) -> Optional[tuple[str, ...]]:
        seen = [d for i, d in enumerate(v or ()) if d in (v or ())[:i]]
        if seen:  # a task is named by its domain in every table, curve and metric: a repeat would overwrite one
            raise ValueError(f"domain {seen[0]!r} appears twice; a stream learns each domain once")
        return v

    @model_validator(mode="after")
    def _one_name_per_client(self) -> "DomainIncrementalSplit":
        if self.names is not None:
            if len(self.names) != self.clients:
                raise ValueError(f"names: {len(self.names)} names for {self.clients} clients")
            if len(set(self.names)) != len(self.names) or not all(n.strip() for n in self.names):
                raise ValueError(f"names: each client needs a name of its own, got {list(self.names)}")
        return self


class HoldoutDomainSplit(Strict):
    """``domain_clients`` over every domain but ``holdout``; the held-out domain becomes a late-joining client
    (``newcomer``: train + test) or an ``external_test`` set (test only)."""

    protocol: Literal["holdout_domain"]
    seed: int = Field(0, ge=0)
    holdout: str
    role: Literal["newcomer", "external_test"] = "newcomer"
    n_train: int = Field(458, ge=1)
    n_test: Optional[int] = Field(None, ge=1)
    n_test_per_domain: dict[str, int] = Field(default_factory=dict)
    domains: Optional[tuple[str, ...]] = None
    test_from: TestFrom = "auto"


class ByWriterSplit(Strict):
    """The natural partition of data whose records name their writer (FEMNIST): each client is one writer and holds all
    of that writer's images. ``clients`` writers are drawn at random (seeded) among those with at least
    ``min_samples`` images (all of them when null). A writer whose images carry the distribution's own train and test
    subsets (LEAF's ``-t sample`` split files) keeps them (data split by writer, LEAF's ``-t user``, is refused); in
    data without such subsets each writer's images are split as LEAF's ``split_data.py --by_sample`` splits them:
    max(1, floor((1 - test_fraction) x n)) train, the rest test (n = 2: one each), writers with fewer than two images
    left out."""

    protocol: Literal["by_writer"]
    seed: int = Field(0, ge=0)
    clients: Optional[int] = Field(None, ge=2, description="writers drawn as clients (null: every eligible writer)")
    min_samples: int = Field(2, ge=2, description="writers with fewer images are never drawn (LEAF's -k)")
    test_fraction: float = Field(0.1, gt=0, lt=1, description="each writer's test share where the data has no split of its own (LEAF's --tf 0.9)")


SPLIT_PROTOCOLS = ("domain_clients", "domain_multi_clients", "label_skew", "domain_incremental", "holdout_domain", "by_writer")
SplitParams = Annotated[
    Union[DomainClientsSplit, DomainMultiClientsSplit, LabelSkewSplit, DomainIncrementalSplit, HoldoutDomainSplit, ByWriterSplit],
    Field(discriminator="protocol"),
]
DatasetParams = Annotated[Union[CXRDatasetParams, BenchmarkDatasetParams, SingleDomainDatasetParams], Field(discriminator="kind")]


# --------------------------------------------------------------------------- train
class HostTransformParams(BaseModel):
    """One albumentations transform of a host policy: ``name`` (its class) and its own arguments, passed as given and
    checked by albumentations when the policy is built (``fedsilo.client.hostaug``)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(..., min_length=1, description="an albumentations transform, e.g. CLAHE, Affine, RandomBrightnessContrast")


class AugmentParams(Strict):
    hflip: bool = False
    crop_pad: int = Field(0, ge=0)
    host: tuple[HostTransformParams, ...] = Field(
        (), description="albumentations transforms run on the host per image before the batch goes to the device "
        "(medical-style: CLAHE, Affine, RandomBrightnessContrast, ...); flips and crops above stay on the device"
    )


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class NormalizeParams(Strict):
    """The model's input scale: an image's uint8 value v becomes (v / 255 - mean) / std, per channel, as torchvision's
    ``ToTensor`` then ``Normalize(mean, std)`` make it in the papers' code. One value applies to every channel, or one
    per channel of the images. The default (0.5, 0.5) is [-1, 1] (FedBN's digits, MOON); ``imagenet`` stands for
    torchvision's ImageNet statistics (F²DC's code, every dataset); mean 0 and std 1 is ToTensor alone ([0, 1])."""

    mean: tuple[Annotated[float, Field(ge=0, le=1)], ...] = Field(
        (0.5,), min_length=1, description="subtracted after scaling to [0, 1]: one value, or one per channel (on that "
        "[0, 1] scale, as torchvision's: ImageNet's 0.485, not 123.7)",
    )
    std: tuple[Annotated[float, Field(gt=0, le=1)], ...] = Field(
        (0.5,), min_length=1, description="divided by after: one value, or one per channel (on the [0, 1] scale)"
    )

    @model_validator(mode="before")
    @classmethod
    def _named(cls, v: Any) -> Any:
        if v == "imagenet":
            return {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}
        if isinstance(v, str):
            raise ValueError(f"{v!r}: expected imagenet or {{mean: [...], std: [...]}}")
        return v

    @model_validator(mode="after")
    def _lengths(self) -> "NormalizeParams":
        if len(self.mean) != len(self.std) and 1 not in (len(self.mean), len(self.std)):
            raise ValueError(f"mean has {len(self.mean)} values and std {len(self.std)}: give one value or one per channel for each")
        return self

    @property
    def minus_one_one(self) -> bool:
        """[-1, 1], however written (one 0.5 or one per channel)."""
        return set(self.mean) == {0.5} and set(self.std) == {0.5}

    def channel_mismatch(self, channels: int) -> Optional[str]:
        """Why these statistics do not fit images of ``channels`` channels, or None."""
        for name, vals in (("mean", self.mean), ("std", self.std)):
            if len(vals) not in (1, channels):
                return f"{name} has {len(vals)} values for images of {channels} channel(s): give one, or {channels}"
        return None


# The smallest image edge (px) each backbone's strides and poolings still leave a feature map at (measured by a
# forward pass; tests/test_errors_and_hygiene.py checks the table); the other backbones take any image_size >= 8.
MIN_IMAGE_SIZE = {"alexnet_bn": 63, "densenet121": 29, "lenet5": 16, "fedecouple_cnn": 16, "fedecouple_cnn_gray": 12}
# the backbones train.model_width builds at another width (the others are their papers' fixed architectures)
WIDTH_SCALED = frozenset({"simple_cnn"})
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$")
DEVICE_FORMS = "auto, cpu, cuda or cuda:N (N = 0, 1, ...)"


def min_image_size(model: str) -> int:
    return MIN_IMAGE_SIZE.get(model, 8)


class LRScheduleParams(Strict):
    """The learning rate across rounds. A client's optimizers are fresh every round (FedAvg's ClientUpdate), so a
    schedule sets the rate each round's local training starts from: ``train.lr`` (and every other learning rate of
    the round's local training: a phase's, a classifier epoch's, FedCIL's Adam) times factor(r) for round
    r = 1 .. train.rounds. In a task stream ``train.rounds`` is a task's rounds and the schedule restarts with every
    task. Not scheduled: a server's own optimizer (FedTGP's generator, FedCIL's consolidation), the fine-tuning a
    client does to be evaluated (FT-FedAvg, FedBABU: their ``finetune_*`` settings) and pFedDB's onboarding of a
    newcomer (its rounds are not the federation's)."""

    kind: Literal["constant", "step", "exponential", "cosine"] = Field(
        "constant", description="constant: factor 1; step: gamma after each milestone (FedBABU's code: x0.1 after T/2 "
        "and 3T/4); exponential: gamma^(r-1) (FedRCL's code: 0.998; FDSE's: 0.9998); cosine: from 1 down to "
        "min_factor, as torch's CosineAnnealingLR(T_max=train.rounds) stepped once a round",
    )
    gamma: Optional[float] = Field(None, gt=0, lt=1, description="step: the factor at each milestone; exponential: the factor per round")
    milestones: tuple[int, ...] = Field((), description="step: the rounds after which the rate is multiplied by gamma")
    min_factor: float = Field(0.0, ge=0, lt=1, description="cosine: the factor it reaches after the last round")
    warmup_rounds: int = Field(0, ge=0, description="linear warm-up: round r <= warmup_rounds trains at r / warmup_rounds "
                               "of the schedule's rate (0: none; 1 would change no round and is refused)")

    @field_validator("milestones", mode="before")
    @classmethod
    def _one_milestone(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) and not isinstance(v, bool) else v  # `milestones: 150` for [150]

    @model_validator(mode="after")
    def _fits_kind(self) -> "LRScheduleParams":
        if self.kind in ("step", "exponential") and self.gamma is None:
            raise ValueError(f"gamma: kind {self.kind} needs its factor (e.g. 0.1 for step, 0.998 for exponential)")
        if self.kind not in ("step", "exponential") and self.gamma is not None:
            raise ValueError(f"gamma: applies to kind step or exponential, not {self.kind}")
        if self.kind == "step" and not self.milestones:
            raise ValueError("milestones: kind step needs the rounds after which the rate drops")
        if self.kind != "step" and self.milestones:
            raise ValueError(f"milestones: apply to kind step, not {self.kind}")
        if list(self.milestones) != sorted(set(self.milestones)) or any(m < 1 for m in self.milestones):
            raise ValueError(f"milestones: rounds >= 1 in increasing order, got {list(self.milestones)}")
        if self.warmup_rounds == 1:
            raise ValueError("warmup_rounds: 1 changes no round (round 1 at 1/1 of its rate); 0 for none, 2 or more to warm up")
        if self.milestones and self.warmup_rounds > self.milestones[0]:
            raise ValueError(f"warmup_rounds: {self.warmup_rounds} reaches past the first milestone ({self.milestones[0]}): the "
                             "rate would drop while it still warms up")
        if self.kind != "cosine" and self.min_factor:
            raise ValueError(f"min_factor: applies to kind cosine, not {self.kind}")
        return self

    def factor(self, rnd: int, rounds: int) -> float:
        """The multiplier of round ``rnd``'s learning rates (1-based; in a task stream, rounds count within the task:
        ``rounds`` is a task's)."""
        r = (rnd - 1) % rounds + 1
        if self.kind == "step":
            f = float(self.gamma) ** sum(m < r for m in self.milestones)  # type: ignore[arg-type]
        elif self.kind == "exponential":
            f = float(self.gamma) ** (r - 1)  # type: ignore[arg-type]
        elif self.kind == "cosine":
            f = self.min_factor + (1 - self.min_factor) * (1 + math.cos(math.pi * (r - 1) / rounds)) / 2
        else:
            f = 1.0
        if self.warmup_rounds and r <= self.warmup_rounds:
            f *= r / self.warmup_rounds
        return f


class LocalOptimizer(Strict):
    """``methods.<key>.local_optimizer``: the optimizer settings of this method's local training where they differ from
    the experiment's ``train`` (a key left out keeps the experiment's): an authors' code that trains its method with
    another optimizer than the baselines of the same table (F²DC's: SGD lr 0.1, no momentum, no weight decay), beside
    them on the same federation."""

    optimizer: Optional[Literal["sgd", "adam"]] = None
    lr: Optional[float] = Field(None, gt=0)
    momentum: Optional[float] = Field(None, ge=0, lt=1)
    nesterov: Optional[bool] = None
    betas: Optional[tuple[float, float]] = None
    eps: Optional[float] = Field(None, gt=0)
    weight_decay: Optional[float] = Field(None, ge=0)

    def applied(self, train: "TrainParams", what: str) -> "TrainParams":
        """``train`` with these settings in place of its own, validated as a whole (``what`` names the key in errors)."""
        given = self.model_dump(exclude_none=True)
        if not given:
            return train
        try:
            return TrainParams.model_validate({**train.model_dump(), **given})
        except ValidationError as err:
            msg = err.errors()[0]["msg"].removeprefix("Value error, ")
            raise ConfigError(f"{what}: {msg} (the train it changes: {train.optimizer}, lr {train.lr}, momentum "
                              f"{train.momentum}, nesterov {train.nesterov}; a key left out keeps the train's value: set "
                              "it here too)") from None


class TrainParams(Strict):
    model: Literal[
        "simple_cnn", "alexnet_bn", "densenet121", "resnet10", "resnet10_cifar", "resnet18", "resnet34", "resnet34_cifar", "resnet32", "lenet5",
        "fedecouple_cnn", "fedecouple_cnn_gray", "vit_tiny",
    ] = "simple_cnn"
    model_width: float = Field(
        1.0, gt=0, le=4, description="simple_cnn's channels and hidden units times this (1.0: FedBN's DigitModel; 0.25: "
        "the same layers with 16x fewer weights, for CPU quickstarts and pipeline checks); the other models have "
        "their papers' fixed widths",
    )
    rounds: int = Field(300, ge=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    optimizer: Literal["sgd", "adam"] = Field(
        "sgd", description="local optimizer, a fresh one each local update: sgd (lr, momentum, nesterov, weight_decay) "
        "or adam (torch.optim.Adam: lr, betas, eps, weight_decay as an L2 term)",
    )
    lr: float = Field(1e-2, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD's momentum (Adam's are betas)")
    nesterov: bool = Field(False, description="Nesterov momentum (needs momentum > 0; CD2-pFed's SGD)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam's (beta1, beta2), torch's defaults")
    eps: float = Field(1e-8, gt=0, description="Adam's epsilon, torch's default")
    weight_decay: float = Field(0.0, ge=0)
    client_fraction: float = Field(1.0, gt=0, le=1)
    client_fraction_range: Optional[tuple[float, float]] = Field(
        None, description="[low, high]: each round's join ratio drawn uniformly from it, seeded by (seed, round), in place "
        "of client_fraction (FedeCouple Fig. 12's random aggregation ratios)",
    )
    eval_every: int = Field(1, ge=1)
    augment: AugmentParams = AugmentParams()
    normalize: NormalizeParams = Field(
        NormalizeParams(), description="the model's input scale: (v / 255 - mean) / std per channel; [-1, 1] by default, "
        "imagenet for torchvision's ImageNet statistics (F²DC's code)",
    )
    lr_schedule: LRScheduleParams = Field(
        LRScheduleParams(), description="the learning rate across rounds (constant by default): step, exponential or "
        "cosine decay, with an optional linear warm-up; it scales every learning rate of a round's local training",
    )
    device: str = Field("auto", description="auto (the first CUDA device, else the CPU), cpu, cuda or cuda:N")
    amp: Literal["auto", "off", "bf16"] = Field("auto", description="auto = bf16 autocast on CUDA, off on CPU")
    channels_last: Literal["auto", "on", "off"] = Field("auto", description="auto = on for CUDA convnets")
    compile: bool = Field(False, description="torch.compile the model once per run")
    deterministic: bool = Field(
        False, description="deterministic kernels (torch.use_deterministic_algorithms, cuDNN without autotuning, "
        "cuBLAS's fixed workspace): the same numbers for the same seed on a GPU too, at some speed; on the CPU the "
        "kernels already are; an op with no deterministic kernel stops the run naming it",
    )
    count_flops: bool = Field(
        True, description="count the floating-point operations of the last round's local training (matrix products "
        "and convolutions, forward and backward, torch.utils.flop_counter; the last round is a method's steady state: "
        "its references, prototypes and phases are in place) into history and metrics.json (F²DC Table 4)",
    )
    parallel_clients: int = Field(
        1, ge=1, description="clients of a round trained at once, each on its own copy of the model (its own CUDA "
        "stream on a GPU; on the CPU each gets threads / parallel_clients of the run's torch threads): several small "
        "clients fill a device one leaves idle. Downloads, uploads and aggregation keep the clients' order, so the "
        "numbers equal a one-at-a-time run with as many threads per client (on a GPU with deterministic kernels: the same numbers). Methods whose "
        "local update keeps state on the method object train one at a time (recorded in metrics.json's engine block)",
    )
    checkpoint_every: Union[int, Literal["auto"]] = Field(
        "auto", description="when the checkpoint (server state, client stores, history) is written; the last round "
        "always is. auto: after a round that ends once the wall time since the last write has reached 20 times what "
        "that write took (a small model's every round, a large personal-model store's every minute or so: the writes "
        "take at most ~5 % of the run); k: every k rounds. A run killed between two writes resumes from the earlier "
        "and trains the rounds after it again, ending with the same numbers; a SIGTERM ends the round in flight and "
        "writes it first",
    )
    store_device: Literal["auto", "device", "host"] = Field(
        "auto", description="where client stores live: on the device when they fit, else pinned host memory"
    )
    ensemble_test: bool = Field(
        False, description="also score the ensemble of every client's evaluation model (mean softmax) on the union of "
        "the clients' test sets at each evaluation: LG-FedAvg's and CD2-pFed's 'new test'; the models' bytes are "
        "counted as bytes_ensemble. Always on when the split holds an external test site",
    )
    ensemble_mean: Literal["probabilities", "log_probabilities"] = Field(
        "probabilities", description="what the ensemble ('new test') averages over the clients' models: their softmax "
        "probabilities, or their log-probabilities (a normalized geometric mean, as LG-FedAvg's code averages its "
        "log_softmax outputs; CD2-pFed follows it)",
    )
    keep_client_models: bool = Field(
        False, description="also save every client's store (private tensors, personal models) in final_model.pt; the "
        "server state is always saved. Not part of the run's hash: it changes what is saved, not what is trained"
    )

    @field_validator("lr_schedule", mode="before")
    @classmethod
    def _no_schedule(cls, v: Any) -> Any:
        return {} if v is None else v  # `lr_schedule:` left empty, or null: the constant rate

    @field_validator("checkpoint_every", mode="before")
    @classmethod
    def _checkpoint_every(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError(f"expected auto or a whole number of rounds >= 1, got {v!r}")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not DEVICE_RE.match(v):
            raise ValueError(f"'{v}' is not a device; use {DEVICE_FORMS}")
        return v

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> "TrainParams":
        if self.model_width != 1.0 and self.model not in WIDTH_SCALED:
            raise ValueError(f"model_width: {self.model_width}, but {self.model} is built at its paper's width only "
                             f"(model_width applies to {', '.join(sorted(WIDTH_SCALED))}); set it to 1.0")
        if self.nesterov and self.momentum <= 0:
            raise ValueError("nesterov: Nesterov momentum needs momentum > 0")
        if self.optimizer == "adam" and (self.momentum > 0 or self.nesterov):
            raise ValueError("momentum: SGD's momentum (and nesterov) with optimizer: adam; Adam's moments are betas")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: each of Adam's betas must be in [0, 1), got {list(self.betas)}")
        if self.parallel_clients > 1 and self.compile:
            raise ValueError("parallel_clients: torch.compile'd models are not trained from several threads (TorchDynamo "
                             "is not thread-safe); set compile: false or parallel_clients: 1")
        late = [m for m in self.lr_schedule.milestones if m >= self.rounds]
        if late:
            raise ValueError(f"lr_schedule.milestones: {late} not below rounds ({self.rounds}): a drop after the last "
                             "round changes no round")
        if self.lr_schedule.warmup_rounds >= self.rounds:
            raise ValueError(f"lr_schedule.warmup_rounds ({self.lr_schedule.warmup_rounds}) must be below rounds ({self.rounds})")
        if self.client_fraction_range is not None:
            lo, hi = self.client_fraction_range
            if not 0 < lo <= hi <= 1:
                raise ValueError(f"client_fraction_range: needs 0 < low <= high <= 1, got [{lo}, {hi}]")
        return self


class OnboardingParams(Strict):
    """pFedDB Fig. 6: a held-out newcomer adapts with freeze_global / finetune_all / from_scratch."""

    pretrain_rounds: int = Field(10, ge=0, description="rounds of the newcomer's pre-existing local (single-branch) model")
    rounds: int = Field(20, ge=1, description="adaptation rounds per strategy, evaluated after each")


class ExperimentParams(Strict):
    dataset: str
    split: SplitParams
    onboarding: OnboardingParams = OnboardingParams()
    published: Optional[str] = Field(
        None, description="'<file>#<table>' of a paper's published accuracies (e.g. pipelines/pfeddb/published.yaml#chest_xray4) the report sets ours beside"
    )
    target_accuracy: Optional[float] = Field(
        None, gt=0, le=100, description="mean client test accuracy (%) whose first crossing the report times per method: "
        "rounds, training seconds and MiB per client until then (FedeCouple Table VII)",
    )

    @field_validator("split", mode="before")
    @classmethod
    def _default_protocol(cls, v: Any) -> Any:
        if isinstance(v, dict) and "protocol" not in v:
            return {"protocol": "domain_clients", **v}
        return v
    train: TrainParams = TrainParams()


# --------------------------------------------------------------------------- pipeline / report
def seeds_listed(v: Any) -> Any:
    """A bare number where a list of seeds belongs: refused with the list it likely means."""
    if isinstance(v, (int, str)) and not isinstance(v, bool):
        raise ValueError(f"{v!r}: seeds are a list, one run of each method per seed (e.g. seeds: [{v}])")
    return v


def distinct_seeds(v: tuple[int, ...]) -> tuple[int, ...]:
    """Seeds given each once (a seed is one run of each method: twice would be one run counted as two), none
    negative (the seeded streams of every round take non-negative keys only)."""
    negative = sorted({s for s in v if s < 0})
    if negative:
        raise ValueError(f"seed(s) {negative}: a seed is a non-negative integer (0, 1, 2, ...)")
    twice = sorted({s for s in v if v.count(s) > 1})
    if twice:
        raise ValueError(f"seed(s) {twice} listed twice: a seed is one run of each method (give each once)")
    return v


# a pipeline's or a paper's seeds: a list (a bare number refused), each given once, none negative
Seeds = Annotated[tuple[int, ...], BeforeValidator(seeds_listed), AfterValidator(distinct_seeds)]


class PipelineParams(Strict):
    sources: tuple[str, ...]
    datasets: tuple[str, ...]
    splits: dict[str, str] = Field(description="experiment -> its dataset: the split stages dvc.yaml expands")
    experiments: tuple[str, ...] = Field(description="experiments trained and reported (each must be in splits)")
    methods: tuple[str, ...]
    seeds: Seeds
    onboarding: tuple[str, ...] = Field((), description="holdout_domain experiments whose newcomer onboarding (pFedDB Fig. 6) dvc.yaml runs")


class TrackingParams(Strict):
    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"


class RunGroup(Strict):
    """Runs a paper's table or figure needs: every listed experiment with every listed method, for each seed."""

    experiments: tuple[str, ...] = Field(min_length=1)
    methods: tuple[str, ...] = Field(
        description="empty: the group trains nothing (dvc.yaml keeps its train_<group> stage group, with no stage)"
    )
    beside: tuple[str, ...] = Field(
        (), description="methods another group trains on these experiments that the table sets beside this group's (an "
        "ablation's full method): `fedsilo report --group` reports them too"
    )
    beside_experiments: tuple[str, ...] = Field(
        (), description="experiments another group trains this group's methods on that its table across experiments "
        "sets beside its own (CD2-pFed's Fig. 5: s = 2 is Table 1's experiment): `fedsilo report --group` reads them too"
    )
    across: bool = Field(
        False, description="one table and figure across the group's experiments (beside_experiments with them), a "
        "column per value of the setting that tells them apart and a row per method (and dataset, where they span "
        "several; two or more experiments of each): dvc.yaml's across_<group> stage writes it (CD2-pFed's Fig. 5, "
        "FedeCouple's Fig. 12 and Table XII)"
    )
    published: Optional[str] = Field(
        None, description="with across: '<file>#<key>' of the paper's numbers for the table across experiments (the "
        "file's `across` section), set beside ours"
    )


class PaperMeta(Strict):
    name: str
    scale: str
    params_file: str
    runs: dict[str, RunGroup]


class Params(Strict):
    """The whole of params.yaml (or of a paper's params file joined with the root's data sections)."""

    sources: dict[str, SourceParams]
    datasets: dict[str, DatasetParams]
    experiments: dict[str, ExperimentParams]
    methods: dict[str, dict[str, Any]]
    pipeline: PipelineParams
    tracking: TrackingParams = TrackingParams()
    _paper: Optional[PaperMeta] = PrivateAttr(None)  # set when loaded from a paper's params file
    _source: str = PrivateAttr("params.yaml")  # the file it was loaded from, as given (errors name it)
    # methods.<key> -> its typed params, filled once by fedsilo.methods.check_methods (this module does not know the
    # method classes)
    _typed_methods: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def paper(self) -> Optional[PaperMeta]:
        return self._paper

    @property
    def source(self) -> str:
        """The params file this was loaded from (as given; ``params.yaml`` for params made in memory)."""
        return self._source

    def layout(self, root: str | Path = ".") -> Layout:
        return Layout(Path(root), f"{self._paper.name}/{self._paper.scale}" if self._paper else "")

    def train_stage(self, experiment: str, method: str, seed: int) -> str:
        """``dvc repro``'s target for the run (experiment, method, seed): the root's ``train@...``, a paper's
        ``train_<group>@...`` of the group that trains it."""
        item = f"{experiment}-{method}-{seed}"
        if self._paper is None:
            return f"train@{item}"
        group = next((g for g, grp in self._paper.runs.items() if experiment in grp.experiments and method in grp.methods), None)
        if group is None:
            raise ConfigError(f"{self._paper.params_file}: runs: no group trains '{method}' on '{experiment}'")
        return self.stage_target(f"train_{group}@{item}")

    def stage_target(self, stage: str) -> str:
        """``dvc repro``'s target for a stage of this params file's pipeline: the root's by name, a paper's through the
        dvc.yaml beside its params file (``pipelines/pfeddb/dvc.yaml:split@pfeddb_cxr4``)."""
        if self._paper is None:
            return stage
        return f"{Path(self._paper.params_file).parent.as_posix()}/dvc.yaml:{stage}"

    def experiment_methods(self, experiment: str) -> tuple[str, ...]:
        """The methods trained on ``experiment``: a paper's run groups that list it, else pipeline.methods."""
        if self._paper is None:
            return tuple(self.pipeline.methods)
        out: dict[str, None] = {}
        for g in self._paper.runs.values():
            if experiment in g.experiments:
                out.update(dict.fromkeys(g.methods))
        return tuple(out)

    @field_validator("datasets", mode="before")
    @classmethod
    def _default_kind(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {k: ({"kind": "chest_xray4", **d} if isinstance(d, dict) and "kind" not in d else d) for k, d in v.items()}
        return v

    @model_validator(mode="after")
    def _cross_refs(self) -> "Params":
        for s, sp in self.sources.items():
            if sp.reader is not None:
                if s in SOURCE_MODES:
                    raise ValueError(f"sources.{s}.reader: {s} is a public source with its own reader; give your own "
                                     f"source another name (e.g. {s}_site) or drop 'reader'")
                if not SOURCE_NAME.fullmatch(s):
                    raise ValueError(f"sources.{s}: a source of your own needs a name of lower-case letters, digits and _ "
                                     "(it names the folder data/raw/<name> and the DVC stage fetch@<name>)")
                modes = OWN_READERS[sp.reader]
                if sp.mode not in modes:
                    raise ValueError(f"sources.{s}.mode: {sp.mode!r} is not offered by reader {sp.reader} (its modes: {', '.join(modes)})")
                continue
            if s not in SOURCE_MODES:
                raise ValueError(f"sources.{s}: unknown source (known: {', '.join(SOURCE_MODES)}; a source of your own "
                                 "needs 'reader: cxr_table' (chest X-rays and a label table), 'reader: image_folder' (one "
                                 "folder per class) or 'reader: image_table' (images and a table of their classes))")
            if sp.mode not in SOURCE_MODES[s]:
                raise ValueError(f"sources.{s}.mode: {sp.mode!r} is not offered by {s} (its modes: {', '.join(SOURCE_MODES[s])})")
        for name, ds in self.datasets.items():
            for s in ds.source_list:
                if s not in self.sources:
                    raise ValueError(f"datasets.{name}.sources: '{s}' has no entry under 'sources'")
            if isinstance(ds, CXRDatasetParams):
                _check_cxr_sources(name, ds, self.sources)
            else:
                _check_folder_sources(name, ds, self.sources)
        for name, ex in self.experiments.items():
            if ex.dataset not in self.datasets:
                raise ValueError(f"experiments.{name}.dataset: '{ex.dataset}' is not under 'datasets'")
            _check_model_fits(name, ex, ex.dataset, self.datasets[ex.dataset].image_size)
        for e in self.pipeline.experiments:
            if e not in self.pipeline.splits:
                raise ValueError(f"pipeline.experiments: '{e}' is trained but its split is not built (add it to pipeline.splits)")
        for e in self.pipeline.onboarding:
            if e not in self.pipeline.experiments:
                raise ValueError(f"pipeline.onboarding: '{e}' must also be in pipeline.experiments (pFedDB is trained on it first)")
            if "pfeddb" not in self.pipeline.methods:
                raise ValueError("pipeline.onboarding: needs pfeddb in pipeline.methods")
            sp = self.experiments[e].split if e in self.experiments else None
            if sp is None or sp.protocol != "holdout_domain" or sp.role != "newcomer":
                raise ValueError(f"pipeline.onboarding: experiments.{e}.split must be holdout_domain with role newcomer")
        for e, d in self.pipeline.splits.items():
            if e in self.experiments and self.experiments[e].dataset != d:
                raise ValueError(f"pipeline.splits.{e}: '{d}' differs from experiments.{e}.dataset '{self.experiments[e].dataset}'")
        for key, known in (
            ("sources", self.sources),
            ("datasets", self.datasets),
            ("splits", self.experiments),
            ("experiments", self.experiments),
            ("methods", self.methods),
        ):
            for item in getattr(self.pipeline, key):
                if item not in known:
                    raise ValueError(f"pipeline.{key}: '{item}' is not defined under '{key}'{did_you_mean(item, known)}"
                                     + (METHOD_ENTRY_HINT.format(m=item) if key == "methods" else ""))
        for d in self.pipeline.datasets:  # harmonize@<d> reads data/raw/<s>, which only fetch@<s> writes
            missing = [s for s in self.datasets[d].source_list if s not in self.pipeline.sources]
            if missing:
                raise ValueError(f"pipeline.datasets: '{d}' is harmonized from {', '.join(missing)}, which "
                                 f"{'is' if len(missing) == 1 else 'are'} not in pipeline.sources (add "
                                 f"{'it' if len(missing) == 1 else 'them'} there: no stage would fetch "
                                 + ", ".join(f"data/raw/{s}" for s in missing) + ")")
        return self


def _check_cxr_sources(name: str, ds: CXRDatasetParams, sources: dict[str, SourceParams]) -> None:
    """A chest X-ray dataset's sources are the public ones or tables of the user's own, each a domain of its own."""
    for s in ds.own_sources():
        if sources[s].reader != "cxr_table":
            raise ValueError(f"datasets.{name}.sources: '{s}' is not a chest X-ray source (chexpert, openi, rsna, vinbigdata, "
                             f"chest_xray4_released) nor one with reader: cxr_table (sources.{s}.reader)")
    domains: dict[str, str] = {}
    for s in ds.sources:
        if ds.domain_of(s) in RESERVED_DOMAINS:  # a source named like a report column, with no domain of its own set
            raise ValueError(f"datasets.{name}.tables.{s}.domain: {ds.domain_of(s)!r} (the source's name) is a column of the "
                             f"report's tables ({', '.join(sorted(RESERVED_DOMAINS))}): set another 'domain'")
        for dom in ds.domains_of(s):
            key = dom.strip().casefold()
            if key in domains:
                mine = s if s in ds.own_sources() else domains[key]
                raise ValueError(f"datasets.{name}.tables.{mine}.domain: {dom!r} is also the domain of "
                                 f"{domains[key] if mine == s else s}; every source forms a domain of its own (set a distinct 'domain')")
            domains[key] = s


def _check_folder_sources(name: str, ds: BenchmarkDatasetParams, sources: dict[str, SourceParams]) -> None:
    """A benchmark dataset's sources of your own are image folders, and the domains they name are their own."""
    seen: dict[str, str] = {}
    for s in ds.own_sources():
        reader = sources[s].reader
        if reader not in ("image_folder", "image_table"):
            raise ValueError(f"datasets.{name}.sources: '{s}' is not a source of {ds.kind} nor one with reader: image_folder "
                             f"or image_table (sources.{s}.reader is {reader}" + ("; chest X-rays with a label table join a "
                             "kind: chest_xray4 dataset)" if reader == "cxr_table" else ")"))
        if reader == "image_table" and s not in ds.tables:
            raise ValueError(f"datasets.{name}.tables.{s}: missing; a source with reader: image_table needs its table's "
                             "rules (at least the label column: label, or label_columns)")
        if reader == "image_folder" and s in ds.tables:
            raise ValueError(f"datasets.{name}.tables.{s}: {s} has reader: image_folder (its rules go under folders.{s}); "
                             f"a table of its classes needs sources.{s}.reader: image_table")
        dom = ds.domain_of(s)
        if dom is None:
            continue
        key = ds.rules_key(s, name)
        if dom in RESERVED_DOMAINS:  # the source's name, no domain of its own set
            raise ValueError(f"{key}.domain: {dom!r} (the source's name) is a column of the report's "
                             f"tables ({', '.join(sorted(RESERVED_DOMAINS))}): set another 'domain'")
        folded = dom.strip().casefold()
        if folded in seen:
            raise ValueError(f"{key}.domain: {dom!r} is also the domain of {seen[folded]}; every source "
                             "forms a domain of its own (set a distinct 'domain')")
        seen[folded] = s


def _check_model_fits(experiment: str, ex: ExperimentParams, dataset: str, size: int) -> None:
    """A backbone too deep for the images fails here, naming both keys, not at the first batch inside PyTorch."""
    model, need = ex.train.model, min_image_size(ex.train.model)
    if size < need:
        fits = [m for m in get_args(TrainParams.model_fields["model"].annotation) if min_image_size(m) <= size]
        raise ValueError(
            f"experiments.{experiment}.train.model: {model} needs images of at least {need} px, but "
            f"datasets.{dataset}.image_size is {size}; raise datasets.{dataset}.image_size to {need} or more (harmonize "
            f"reruns), or set experiments.{experiment}.train.model to one that takes {size} px ({', '.join(fits)})"
        )


def _drop_union_tags(loc: tuple) -> tuple:
    """pydantic puts a tagged union's discriminator value into the error path (``datasets.x.digits5.image_size``);
    the user never wrote it, so it is dropped."""
    tags = set(SPLIT_PROTOCOLS) | set(DATASET_SOURCES)
    out = []
    for i, part in enumerate(loc):
        if part in tags and i > 0 and (loc[i - 1] == "split" or (i >= 2 and loc[i - 2] == "datasets")):
            continue
        out.append(part)
    return tuple(out)


# a method trained needs its entry, even a registered method run with its defaults (`fedsilo methods` lists them)
METHOD_ENTRY_HINT = "; every method trained needs an entry under methods (`{m}: {{}}`: a registered method with its defaults; `fedsilo methods` lists them)"


def did_you_mean(name: str, known: Any) -> str:
    """`` (did you mean 'x'?)`` when ``name`` is a near miss of one of ``known`` (a typo), else ""."""
    import difflib

    # never the name itself (a key valid in another section, given in the wrong one)
    close = difflib.get_close_matches(str(name), [str(k) for k in known if str(k) != str(name)], n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _all_keys() -> set[str]:
    """Every key of every params model loaded so far (the sections' and the imported methods' own): the names an
    unknown key may be a typo of."""
    out: set[str] = set()
    todo: list[type] = [Strict]
    while todo:
        cls = todo.pop()
        out.update(getattr(cls, "model_fields", {}))
        todo.extend(cls.__subclasses__())
    return out


def _models_in(annotation: Any) -> tuple[list[type], bool]:
    """The params models an annotation holds (through Optional, Union, Annotated) and whether they sit in a container
    (a mapping, list or tuple: the next part of an error's location is a key or an index)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    if origin is Annotated:
        return _models_in(args[0])
    if origin in (Union, types.UnionType):
        found, inside = [], False
        for a in args:
            m, c = _models_in(a)
            found += m
            inside = inside or c
        return found, inside
    if origin in (dict, list, tuple):
        m, _ = _models_in(args[-1] if origin is dict else args[0]) if args else ([], False)
        return m, True
    return [], False


def _tagged(found: list[type], tag: Any) -> Optional[type]:
    """The member of a tagged union (``found``) whose discriminator (a one-value Literal field: a split's
    ``protocol``, a dataset's ``kind``) is ``tag``, or None."""
    for m in found:
        for f in m.model_fields.values():
            if get_origin(f.annotation) is Literal and get_args(f.annotation) == (tag,):
                return m
    return None


def _union_at(model: Optional[type], loc: tuple) -> tuple[Optional[type], list[type]]:
    """The params model at error location ``loc`` (its parent's path) under ``model``, and where the last step was
    a tagged union's member (pydantic names the tag in the path), the union's members; (None, []) where the path is
    not followed to one model."""
    parts, members = list(loc), []
    while parts and model is not None:
        part = parts.pop(0)
        field = model.model_fields.get(str(part))
        if field is None:
            return None, []
        found, inside = _models_in(field.annotation)
        if inside and parts:
            parts.pop(0)  # the mapping's key or the list's index
        members = []
        if len(found) > 1 and parts and (member := _tagged(found, parts[0])) is not None:
            parts.pop(0)  # the tag pydantic put in the path
            model, members = member, found
            continue
        if len(found) != 1:  # a value that is no model, or one of several untagged: not followed
            return None, []
        model = found[0]
    return model, members


def _fields_at(model: Optional[type], loc: tuple) -> Optional[set[str]]:
    """The keys of the params model at error location ``loc`` (its parent's path) under ``model``, or None where the
    path is not followed to one model (then every known key is a candidate)."""
    found, _ = _union_at(model, loc)
    return set(found.model_fields) if found is not None else None


def _other_members_key(model: Optional[type], loc: tuple, key: Any) -> str:
    """`` (a key of protocol label_skew, not of domain_multi_clients)`` where an unknown key under a tagged union's
    member (a split, a dataset) is one of another member's: the tag was changed and the old settings stayed."""
    own, members = _union_at(model, loc)
    if own is None or not members:
        return ""
    tag_field = next(n for n, f in own.model_fields.items() if get_origin(f.annotation) is Literal and len(get_args(f.annotation)) == 1)
    tag = get_args(own.model_fields[tag_field].annotation)[0]
    others = [get_args(m.model_fields[tag_field].annotation)[0] for m in members
              if m is not own and str(key) in m.model_fields and tag_field in m.model_fields]
    return f" (a key of {tag_field} {', '.join(others)}, not of {tag})" if others else ""


def format_validation_error(err: ValidationError, prefix: str = "", model: Optional[type] = None) -> str:
    """One line: ``<dotted key>: <what is wrong>`` per error, joined by ``; ``. A validator's own message (which
    names its key already where the check spans several) is shown without pydantic's ``Value error,`` prefix. An
    unknown key's near miss is looked for among the keys of its own section (``model``: the params model validated)."""
    lines = []
    for e in err.errors():
        ctx = e.get("ctx") or {}
        loc = _drop_union_tags(tuple(e["loc"])) + ((ctx["field"],) if "field" in ctx else ())
        dotted = ".".join(str(p) for p in loc)
        key = f"{prefix}{dotted}" if dotted else prefix.rstrip(".")
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            own = _fields_at(model, tuple(e["loc"])[:-1]) if model is not None else None
            other = _other_members_key(model, tuple(e["loc"])[:-1], loc[-1]) if model is not None and loc else ""
            msg = "unknown key" + (other or (did_you_mean(loc[-1], own if own is not None else _all_keys()) if loc else ""))
        elif e["type"] == "value_error" and "error" in ctx:
            msg = str(ctx["error"])
        lines.append(f"{key}: {msg}" if key else msg)
    return "; ".join(lines)


def parse_params(raw: dict[str, Any], source: str = "params.yaml") -> Params:
    """Validate every section but the values of ``methods.<key>`` entries, which belong to each method's own params
    class (:func:`fedsilo.methods.check_methods`; :func:`fedsilo.fl.params.load_params` runs both)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    if "paper" in raw:
        raise ConfigError(f"{source}: a paper's params file is read from its place in the repository (load_params)")
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{source}: {format_validation_error(err, model=Params)}") from None


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader refusing a key given twice in one mapping (PyYAML keeps the last silently: `lam: 0.8, ...,
    lam: 0.5` would train 0.5 with no word). Merge keys (`<<: *anchor`) may still be overridden, as YAML means."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice in one mapping (first on line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: not found (run from the repository root)")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    params = load_paper_params(path, raw) if isinstance(raw, dict) and "paper" in raw else parse_params(raw, str(path))
    params._source = str(path)
    return params


# --------------------------------------------------------------------------- a paper's params file
SLUG = r"^[a-z0-9][a-z0-9_]*$"
SLUG_RE = re.compile(SLUG)


class PaperParams(Strict):
    """``pipelines/<paper>/params.yaml`` (one file per scale): the paper's experiments and methods and exactly the
    runs its tables and figures need. Sources and datasets are the root's (``data``): a paper never copies data."""

    paper: str = Field(pattern=SLUG, description="results go under results/<paper>/<scale>/")
    scale: str = Field(pattern=SLUG, description="quickstart, paper, ...")
    params_file: str = Field(description="this file's path from the repository root (dvc.yaml's params dependency)")
    repo_root: str = Field(description="the repository root from this file's folder (dvc.yaml's wdir)")
    data: str = Field("params.yaml", description="the root params file whose sources and datasets the experiments use")
    seeds: Seeds = Field(min_length=1)
    runs: dict[str, RunGroup] = Field(description="group -> experiments x methods; dvc.yaml has a train_<group> stage per group")
    onboarding: tuple[str, ...] = Field((), description="holdout_domain experiments whose newcomer onboarding (pFedDB Fig. 6) runs")
    experiments: dict[str, ExperimentParams]
    methods: dict[str, dict[str, Any]]
    tracking: TrackingParams = TrackingParams()

    @model_validator(mode="after")
    def _runs(self) -> "PaperParams":
        seen: dict[tuple[str, str], str] = {}
        for g, grp in self.runs.items():
            if not SLUG_RE.match(g):
                raise ValueError(f"runs.{g}: a group name is lower-case letters, digits and _ (it names DVC stages)")
            for e in grp.experiments:
                if e not in self.experiments:
                    raise ValueError(f"runs.{g}.experiments: '{e}' is not defined under 'experiments'"
                                     f"{did_you_mean(e, self.experiments)}")
            for m in grp.methods:
                if m not in self.methods:
                    raise ValueError(f"runs.{g}.methods: '{m}' is not defined under 'methods'{did_you_mean(m, self.methods)}"
                                     + METHOD_ENTRY_HINT.format(m=m))
            for key, items in (("experiments", grp.experiments), ("methods", grp.methods), ("beside", grp.beside),
                               ("beside_experiments", grp.beside_experiments)):
                twice = sorted({x for x in items if items.count(x) > 1})
                if twice:
                    raise ValueError(f"runs.{g}.{key}: {', '.join(twice)} listed twice")
            for m in grp.beside:
                if m in grp.methods:
                    raise ValueError(f"runs.{g}.beside: '{m}' is one of the group's own methods")
            for e in grp.experiments:
                for m in grp.methods:
                    if (e, m) in seen:
                        raise ValueError(f"runs.{g}: {e} x {m} is already trained by runs.{seen[(e, m)]} (a run belongs to one group; "
                                         f"to set it in this group's table, list {m} under runs.{g}.beside, or {e} under "
                                         f"runs.{g}.beside_experiments)")
                    seen[(e, m)] = g
        for g, grp in self.runs.items():  # what a group sets beside its own is trained by another group
            for e in grp.experiments:
                for m in grp.beside:
                    if (e, m) not in seen:
                        raise ValueError(f"runs.{g}.beside: no group trains '{m}' on '{e}'")
            for e in grp.beside_experiments:
                if e not in self.experiments:
                    raise ValueError(f"runs.{g}.beside_experiments: '{e}' is not defined under 'experiments'"
                                     f"{did_you_mean(e, self.experiments)}")
                if e in grp.experiments:
                    raise ValueError(f"runs.{g}.beside_experiments: '{e}' is one of the group's own experiments")
                for m in (*grp.methods, *grp.beside):
                    if (e, m) not in seen:
                        raise ValueError(f"runs.{g}.beside_experiments: no group trains '{m}' on '{e}'")
        for g, grp in self.runs.items():
            if grp.published and not grp.across:
                raise ValueError(f"runs.{g}.published: the paper's numbers of a table across experiments; set runs.{g}.across: true")
            if grp.across:
                across_blocks(g, grp, self.experiments)
        trained = {e for e, _ in seen}
        for e in self.experiments:
            if e not in trained:
                raise ValueError(f"experiments.{e}: no runs group trains it")
            if e in ("report", "groups", "across"):  # results/<paper>/<scale>/{report,groups}/, groups/<g>/across/
                raise ValueError(f"experiments.{e}: the name is taken by the {e} folder")
        return self


def across_blocks(group: str, grp: RunGroup, experiments: dict[str, ExperimentParams]) -> dict[str, list[str]]:
    """A run group's experiments for its table across them (``runs.<group>.across``), ``beside_experiments`` first,
    by dataset: each dataset two or more experiments with static clients (a task stream's sweep is pFedDIL's
    ``report --sensitivity``). Which setting tells them apart is the report's to find (:mod:`fedsilo.report.across`)."""
    exps = list(dict.fromkeys([*grp.beside_experiments, *grp.experiments]))
    streams = [e for e in exps if experiments[e].split.protocol == "domain_incremental"]
    if streams:
        raise ValueError(f"runs.{group}.across: '{streams[0]}' is a task stream (its sweeps across streams are "
                         "`fedsilo report --sensitivity`)")
    blocks: dict[str, list[str]] = {}
    for e in exps:
        blocks.setdefault(experiments[e].dataset, []).append(e)
    for d, es in blocks.items():
        if len(es) < 2:
            raise ValueError(f"runs.{group}.across: '{es[0]}' is the group's only experiment on {d}; a table across "
                             "experiments sets two or more of each dataset side by side (add the others, or "
                             "beside_experiments for ones another group trains)")
    return blocks


def load_paper_params(path: Path, raw: dict[str, Any]) -> Params:
    """A paper's params file joined with the sources and datasets of the root params file it names."""
    try:
        pp = PaperParams.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{path}: {format_validation_error(err, model=PaperParams)}") from None
    repo = (path.parent / pp.repo_root).resolve()
    if (repo / pp.params_file).resolve() != path.resolve():
        raise ConfigError(f"{path}: params_file: '{pp.params_file}' (from repo_root '{pp.repo_root}') is not this file")
    data_path = repo / pp.data
    root = load_params(data_path)
    if root.paper is not None:
        raise ConfigError(f"{path}: data: '{pp.data}' is a paper's params file, not the root's")
    unbuilt: dict[str, str] = {}  # dataset -> the first experiment on it
    for e, ex in pp.experiments.items():
        if ex.dataset not in root.pipeline.datasets:
            unbuilt.setdefault(ex.dataset, e)
    if unbuilt:  # every one at once, with the sources their fetch stages need
        defined = [d for d in unbuilt if d in root.datasets]
        sources = sorted({s for d in defined for s in root.datasets[d].source_list} - set(root.pipeline.sources))
        e, d = next(iter(unbuilt.items()))[::-1]
        raise ConfigError(
            f"{path}: experiments.{e}.dataset: '{d}' is not built by {pp.data}"
            + ("" if d in root.datasets else did_you_mean(d, root.datasets))
            + (f"; nor {', '.join(repr(x) for x in list(unbuilt)[1:])}" if len(unbuilt) > 1 else "")
            + " (add each to pipeline.datasets there, defining under datasets any it lacks"
            + (f"; add their sources {', '.join(sources)} to pipeline.sources too, pointed at your copies" if sources else "") + ")"
        )
    for e, ex in pp.experiments.items():
        ds = root.datasets[ex.dataset]
        if ds.own_sources():
            kind = "chest_xray4" if isinstance(ds, CXRDatasetParams) else ds.kind
            raise ConfigError(
                f"{path}: experiments.{e}.dataset: '{ex.dataset}' holds sources of your own in {pp.data} "
                f"({', '.join(ds.own_sources())}); a paper's pipeline reproduces its published tables on the public domains: "
                f"give your sources a dataset of their own there (datasets.<name>: {{kind: {kind}, sources: [...]}}) "
                f"and keep datasets.{ex.dataset} to the public sources"
            )
    methods: dict[str, None] = {}
    for grp in pp.runs.values():
        methods.update(dict.fromkeys(grp.methods))
    pipeline = {
        "sources": root.pipeline.sources,
        "datasets": root.pipeline.datasets,
        "splits": {e: ex.dataset for e, ex in pp.experiments.items()},
        "experiments": tuple(pp.experiments),
        "methods": tuple(methods),
        "seeds": pp.seeds,
        "onboarding": pp.onboarding,
    }
    try:
        params = Params.model_validate({
            "sources": root.sources, "datasets": root.datasets, "experiments": pp.experiments,
            "methods": pp.methods, "pipeline": pipeline, "tracking": pp.tracking,
        })
    except ValidationError as err:
        raise ConfigError(f"{path}: {format_validation_error(err, model=Params)}") from None
    params._paper = PaperMeta(name=pp.paper, scale=pp.scale, params_file=pp.params_file, runs=pp.runs)
    return params
