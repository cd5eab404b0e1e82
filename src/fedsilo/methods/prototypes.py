"""Class prototypes: what prototype methods (FPL, FedTGP, FedSA, ...) compute on the client, send, and cluster.

A client's prototype of class c is the mean representation z = r(x) of its samples of class c; it travels as a
tensor ``proto::<c>`` (d values) beside the model, so the engine counts its bytes like any payload. FINCH (Sarfraz,
Sharma, Stiefelhagen, CVPR 2019) is the parameter-free clustering FPL runs over the clients' prototypes of a class.
:class:`PrototypeSharing` is the shell of a method that shares its whole model and prototypes beside it (FPL, FedTGP,
FedSA): each says only what its client adds to the loss and what its server makes of the round's prototypes.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from scipy.sparse import csr_matrix, identity
from scipy.sparse.csgraph import connected_components

from fedsilo.client.features import classifier
from fedsilo.methods.base import RunningMean, State
from fedsilo.methods.sharing import PartialSharing
from fedsilo.models import LayeredNet

PROTO = "proto::"


class PrototypeSums:
    """Per-class running sums of representations (no gradient), for the mean representation per class."""

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    @torch.no_grad()
    def add(self, z: torch.Tensor, y: torch.Tensor) -> None:
        z = z.detach().float()
        for c in torch.unique(y).tolist():
            sel = z[y == c]
            self.sums[c] = self.sums.get(c, torch.zeros(z.shape[1], device=z.device)) + sel.sum(0)
            self.counts[c] = self.counts.get(c, 0) + int(sel.shape[0])

    def means(self) -> dict[int, torch.Tensor]:
        return {c: self.sums[c] / self.counts[c] for c in sorted(self.sums)}


def class_means(z: torch.Tensor, y: torch.Tensor, chunk: Optional[int] = None) -> dict[int, torch.Tensor]:
    """The mean representation of each class present in ``y`` (FedPAC's local prototypes, FedeCouple's anchors,
    FedTGP's prototypes). ``chunk``: each class summed ``chunk`` rows at a time and the sums added, the order (and so
    the float32 result) of a pass that sums each batch of that size as it goes (our FedTGP's and FedeCouple's
    feature pass, 256 a batch, kept so that their numbers stay as they were; neither authors' code's own order);
    None: over all rows at once (FedPAC's)."""
    sums = PrototypeSums()
    step = chunk or max(len(z), 1)
    for i in range(0, len(z), step):
        sums.add(z[i : i + step], y[i : i + step])
    return sums.means()


def class_table(means: dict[int, torch.Tensor], rows: int, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A (rows x d) table whose row c is class c's vector (zeros for a class without one), so that ``table[y]`` is
    each sample's target in a batch: the anchor or prototype a representation is pulled to; on ``like``'s device
    and dtype (default: the first vector's)."""
    first = next(iter(means.values()))
    table = (like if like is not None else first).new_zeros(rows, first.shape[-1])
    for c, v in means.items():
        table[c] = v.to(table.device, table.dtype)
    return table


def to_payload(protos: dict[int, torch.Tensor], prefix: str = PROTO) -> State:
    return {f"{prefix}{c}": v for c, v in protos.items()}


def from_payload(payload: State, prefix: str = PROTO) -> dict[int, torch.Tensor]:
    return {int(k[len(prefix):]): v for k, v in payload.items() if k.startswith(prefix)}


def mean_and_prototypes(uploads: list[tuple[Any, State]], shared: list[str]) -> tuple[State, list[tuple[int, torch.Tensor]]]:
    """What a prototype method's server reads from a round's uploads: the sample-size-weighted mean of the shared
    tensors, and every uploaded prototype as (class, prototype) in upload order, each client's in class order."""
    mean = RunningMean()
    pairs: list[tuple[int, torch.Tensor]] = []
    for c, up in uploads:
        mean.add(c.n_train, {k: up[k] for k in shared})
        pairs += sorted(from_payload(up, PROTO).items())
    return mean.result(), pairs


def by_class(pairs: list[tuple[int, torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
    """The prototypes of each class, in the order of ``pairs``."""
    out: dict[int, list[torch.Tensor]] = {}
    for cls, v in pairs:
        out.setdefault(cls, []).append(v)
    return out


def _first_neighbour_clusters(x: np.ndarray) -> np.ndarray:
    """FINCH's first-neighbour partition: i and j are linked when one is the other's nearest neighbour (cosine) or
    both have the same nearest neighbour; clusters are the connected components."""
    n = x.shape[0]
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    dist = 1.0 - unit @ unit.T
    np.fill_diagonal(dist, np.inf)
    nn = dist.argmin(axis=1)
    a = csr_matrix((np.ones(n), (np.arange(n), nn)), shape=(n, n)) + identity(n, format="csr")
    _, labels = connected_components(a @ a.T, directed=False)
    return labels.astype(np.int64)


def finch(x: np.ndarray) -> list[np.ndarray]:
    """FINCH's hierarchy of partitions of the rows of ``x`` (cosine, no early-exit threshold), finest first. Each
    level clusters the previous level's cluster means by first neighbours; the recursion stops when a level would
    leave one cluster or merge nothing, and after a level that merged just one pair of clusters (the stopping rule of
    the copy FPL's authors ship; the PyPI package ``finch-clust`` drops such a level instead)."""
    x = np.asarray(x, dtype=np.float64)
    labels = _first_neighbour_clusters(x)
    levels = [labels]
    while True:
        k = int(labels.max()) + 1
        means = np.stack([x[labels == j].mean(0) for j in range(k)])
        merged = _first_neighbour_clusters(means)[labels]
        k_new = int(merged.max()) + 1
        if k_new == 1 or k - k_new < 1:
            return levels
        labels = merged
        levels.append(labels)
        if k - k_new == 1:  # the loop's condition (exit > 1) ends it after keeping this level
            return levels


def cluster_prototypes(protos: list[torch.Tensor]) -> torch.Tensor:
    """FPL's cluster prototypes of one class: the means of the clusters of FINCH's coarsest partition of the
    clients' prototypes (one prototype is its own cluster). Returns k x d."""
    if len(protos) == 1:
        return protos[0][None].float()
    x = torch.stack([p.float().cpu() for p in protos]).numpy()
    labels = finch(x)[-1]
    return torch.stack([torch.from_numpy(x[labels == j].mean(0)) for j in range(int(labels.max()) + 1)])


class PrototypeSharing(PartialSharing):
    """The whole model shared (F²DC's modules, where a method's ``decouple`` adds them, stay on the client) and class
    prototypes beside it. The server's state holds the model's tensors and the method's own (its prototypes, a
    generator); a client downloads the whole state and is evaluated with the model's tensors alone; each round the
    server takes the sample-size-weighted mean of the models and hands the uploaded prototypes to
    :meth:`server_prototypes`."""

    streaming = False

    def shared_keys(self, model: LayeredNet) -> list[str]:
        return list(model.state_dict().keys())

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        head = classifier(model)
        self.num_classes, self.dim = head.out_features, head.in_features  # the prototypes' classes and length

    def download(self, server: State, client, rnd: int) -> State:
        return dict(server)

    def aggregate(self, server: State, uploads: list[tuple[Any, State]], rnd: int) -> State:
        if not uploads:
            return server
        mean, pairs = mean_and_prototypes(uploads, self.shared)
        return {**mean, **self.server_prototypes(server, pairs, rnd)}

    def server_prototypes(self, server: State, pairs: list[tuple[int, torch.Tensor]], rnd: int) -> State:
        """The server's own tensors after a round, from every uploaded (class, prototype) in upload order."""
        raise NotImplementedError

