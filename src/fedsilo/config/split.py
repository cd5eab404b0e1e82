"""The split protocols (``experiments.<e>.split``): what the split stages read. The split stages depend on this
module (with ``base.py``); training sees a split through its file."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BeforeValidator,
    Field,
    field_validator,
    model_validator,
)

from fedsilo.config.base import Strict

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
def _default_protocol(v: Any) -> Any:
    """A split without ``protocol`` is a domain_clients split."""
    return {"protocol": "domain_clients", **v} if isinstance(v, dict) and "protocol" not in v else v


SplitParams = Annotated[
    Union[DomainClientsSplit, DomainMultiClientsSplit, LabelSkewSplit, DomainIncrementalSplit, HoldoutDomainSplit, ByWriterSplit],
    Field(discriminator="protocol"),
    BeforeValidator(_default_protocol),
]
