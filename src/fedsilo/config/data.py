"""The sources and datasets sections: what the fetch, fingerprint and harmonize stages read (``sources.<s>``,
``datasets.<d>``), the harmonization rules and the names a domain may take. The harmonize stages depend on this
module (with ``base.py``): a changed default re-harmonizes; training sees the data through the split's sha256."""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    field_validator,
    model_validator,
)

from fedsilo.config.base import Strict

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


def _default_kind(v: Any) -> Any:
    """A dataset without ``kind`` is a chest X-ray dataset (the root's chest_xray4)."""
    return {"kind": "chest_xray4", **v} if isinstance(v, dict) and "kind" not in v else v


DatasetParams = Annotated[Union[CXRDatasetParams, BenchmarkDatasetParams, SingleDomainDatasetParams], Field(discriminator="kind"),
                          BeforeValidator(_default_kind)]
