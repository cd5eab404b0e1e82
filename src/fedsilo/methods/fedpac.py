"""FedPAC: personalized federated learning with feature alignment and classifier collaboration (Xu, Tong and Huang,
ICLR 2023, "Personalized federated learning with feature alignment and classifier collaboration")."""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedsilo.client.data import ClientData
from fedsilo.client.features import classifier, features_of, representation
from fedsilo.client.local import make_generator, train_local, unscheduled_lr
from fedsilo.methods.base import Method, MethodParams, RunningMean, State
from fedsilo.methods.prototypes import class_means, class_table, from_payload, to_payload
from fedsilo.methods.sharing import frozen, head_and_body, head_and_body_keys
from fedsilo.models import LayeredNet

log = logging.getLogger("fedsilo.fedpac")

STATS = "fedpac::"  # the client's statistics for the server's classifier combination: V_i, H_i, label counts
HEAD = "head::"  # server state: the classifier combined for client <index>, "head::<index>::<key>"


class FedPACParams(MethodParams):
    lam: float = Field(1.0, ge=0, description="lambda: weight of the feature alignment to the global class prototypes (Eq. 8)")
    classifier_epochs: int = Field(1, ge=1, description="epochs on the classifier with the extractor fixed, before the extractor's train.local_epochs")
    classifier_lr: float = Field(0.1, gt=0, description="learning rate of the classifier epochs (the authors' code: 0.1, fixed: train.lr_schedule does not scale it)")
    min_weight: float = Field(1e-3, ge=0, description="combination weights below this are set to zero before the heads are averaged (the code's eps)")
    eig_floor: float = Field(0.01, ge=0, description="when the QP matrix is not positive semidefinite, it is rebuilt from its eigenvalues >= this (the code's stabilizer)")
    align_loss: Literal["mse", "squared_l2"] = Field(
        "mse", description="the alignment term: mse (the code's MSELoss, mean over samples and features) or squared_l2 "
        "(the paper's R_i, each sample's squared distance summed over features, mean over samples: d times mse)")


def statistics(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A client's statistics for the classifier combination (Sec. 4.2, the code's ``statistics_extraction``):
    V_i = [sum_k p_k tr(E[z z^T | y = k]) - sum_k p_k^2 ||mu_k||^2] / n_i and H_i[k] = p_k mu_k, with p_k the client's
    label prior and mu_k its mean feature of class k (rows of absent classes are zero)."""
    z = z.double()
    n = len(y)
    v = torch.zeros((), dtype=torch.float64, device=z.device)
    h = torch.zeros(num_classes, z.shape[1], dtype=torch.float64, device=z.device)
    for k in torch.unique(y).tolist():
        zk = z[y == k]
        p = len(zk) / n
        mu = zk.mean(0)
        h[k] = p * mu
        v = v + p * (zk * zk).sum(1).mean() - p * p * (mu * mu).sum()
    return (v / n).float(), h.float()


def combination_weights(variances: list[float], means: list[torch.Tensor], i: int, min_weight: float = 1e-3, eig_floor: float = 0.01) -> np.ndarray | None:
    """Client i's weights over the m heads (Eq. 10): argmin_a a^T (diag(V) + D_i) a subject to a >= 0, sum a = 1,
    with D_i[j1, j2] = sum_k (H_i[k] - H_j1[k]) . (H_i[k] - H_j2[k]). A matrix that is not positive semidefinite is
    rebuilt from its eigenpairs with eigenvalue >= ``eig_floor``; weights below ``min_weight`` are zeroed. None when
    the solver finds no solution (the client then keeps its own head, as in the code)."""
    hs = torch.stack([h.double().flatten() for h in means]).cpu()
    diff = hs[i][None] - hs  # m x (K d)
    p = (torch.diag(torch.tensor(variances, dtype=torch.float64)) + diff @ diff.T).numpy()
    p = 0.5 * (p + p.T)
    vals, vecs = np.linalg.eigh(p)
    if vals.min() < 0:
        keep = vals >= eig_floor
        p = (vecs[:, keep] * vals[keep]) @ vecs[:, keep].T
    from scipy.optimize import minimize  # here, not at import: every train stage imports the registry

    m = len(means)
    res = minimize(lambda a: a @ p @ a, np.full(m, 1.0 / m), jac=lambda a: 2 * p @ a, method="SLSQP",
                   bounds=[(0.0, 1.0)] * m, constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones_like(a)}],
                   options={"ftol": 1e-12, "maxiter": 500})
    if not res.success:
        return None
    a = np.where(res.x > min_weight, res.x, 0.0)
    return a if a.sum() > 0 else None


class FedPAC(Method):
    """Xu et al. 2023, Algorithm 1. The model is a feature extractor theta (every unit but the last, shared) and a
    classifier phi_i (the last unit, personal); the server also keeps global class prototypes c_k. Each round a
    sampled client

    1. downloads theta and the prototypes (and the classifier the server combined for it last time, which replaces
       its own), and computes V_i and H_i (Sec. 4.2) with its model before training;
    2. trains phi_i for ``classifier_epochs`` with theta fixed (cross entropy), then theta for ``train.local_epochs``
       with phi_i fixed on cross entropy + lambda * MSE(z, c_y) (Eq. 8: features aligned to the global prototype of
       their class; a class without one is aligned to the client's own prototype from before training; no alignment
       in the first round, before any prototype exists);
    3. uploads theta_i, phi_i, its class prototypes after training, its label counts, V_i and H_i.

    The server averages theta weighted by n_i, sets c_k to the count-weighted mean of the clients' prototypes of
    class k, and for each uploader solves the QP of Eq. 10 for weights alpha over the uploaded classifiers and
    combines them, phi_i = sum_j alpha_ij phi_j / sum_j alpha_ij (classifier collaboration). A client is evaluated
    with theta and its combined classifier (its own before it has been combined: the initialization for a client not
    sampled yet, as FedRep's and FedPer's unsampled clients keep their initial heads; FedPAC has no global classifier
    to fall back on, unlike FedeCouple, which scores such a client with its global model).

    Details from the authors' code (github:JianXu95/FedPAC, ``methods/fedpac.py``, ``tools.py``, ``running.py``):
    the classifier epoch's learning rate 0.1 (``classifier_lr``), SGD momentum 0.5 and weight decay 5e-4 for both
    phases (``train``), the alignment term as PyTorch's MSELoss (mean over batch and features: the paper's R_i sums
    each sample's squared distance over the features, d times larger at the same lambda; ``align_loss: squared_l2``
    is the paper's, the presets keep the code's), prototypes aggregated
    by label counts, the extractor by sample counts, the QP matrix's eigenvalue fix and the 1e-3 weight cut. The code
    solves the QP with cvxpy; here SciPy's SLSQP solves the same problem. The code prints two accuracies of each
    sampled client and picks neither: ``acc0``, its model at the start of a round (global theta and the combined
    phi_i it received: what is evaluated here, after the round that combined it) and ``acc2``, its model right
    after its local training, before aggregation; it averages over the round's sampled clients only (here every
    client is scored). The model after the round is the paper's personalized model. FedeCouple, beside which it runs,
    is scored with its post-training model (its Algorithm 1's output), so the two rows differ in when the model is
    taken as well as in the method. The combined classifier reaches the
    client with its next download, whose bytes count it; after the last round it is used for evaluation only."""

    name = "fedpac"
    joinable = True  # the server's parts are per uploader (a combined head once a site uploaded), none sized by the federation: a site may join mid-run
    params_cls = FedPACParams
    params: FedPACParams
    streaming = False

    def setup(self, model: LayeredNet) -> None:
        self.cut = len(model.units) - model.head_units
        self.head_keys, self.body_keys = head_and_body_keys(model, self.cut)
        self.num_classes = classifier(model).out_features

    def resolved(self) -> dict[str, Any]:
        return {"classifier_keys": getattr(self, "head_keys", [])}

    def init_server(self, model: LayeredNet) -> State:
        sd = model.state_dict()
        return {k: sd[k].detach().clone() for k in self.body_keys}

    def init_client(self, model: LayeredNet, client: ClientData) -> State:
        sd = model.state_dict()
        return {k: sd[k].detach().clone() for k in self.head_keys}

    # --- the client
    def download(self, server: State, client: ClientData, rnd: int) -> State:
        mine = f"{HEAD}{client.index}::"
        return {k: v for k, v in server.items() if not k.startswith(HEAD) or k.startswith(mine)}

    def _head_for(self, state: State, client: ClientData) -> State:
        mine = f"{HEAD}{client.index}::"
        return {k[len(mine):]: v for k, v in state.items() if k.startswith(mine)}

    def local_update(self, model, store, payload, client, rnd, seed):
        combined = self._head_for(payload, client)
        if combined:  # the classifier the server combined for this client replaces its own
            for k, v in combined.items():
                store[k] = v.clone()
        model.load_state_dict({**{k: payload[k] for k in self.body_keys}, **{k: store[k] for k in self.head_keys}}, strict=True)
        y, num_classes = client.y_train, self.num_classes
        z0 = features_of(model, client.x_train, self.train.normalize)
        v, h = statistics(z0, y, num_classes)  # with the model the client holds before training
        global_protos = from_payload(payload)
        head, body = head_and_body(model, self.cut)

        with frozen(body), unscheduled_lr():  # the classifier, extractor fixed, at the code's fixed rate
            cl = self.train.model_copy(update={"lr": self.params.classifier_lr})
            train_local(model, client, cl, make_generator(seed, rnd, client.index, 0), epochs=self.params.classifier_epochs, params=head)
        with frozen(head), representation(model) as rep:  # the extractor, classifier fixed, features aligned
            align = None
            if rnd > 1 and global_protos and self.params.lam > 0:
                # the global prototype where one exists, else the client's own
                table = class_table({**class_means(z0, y), **global_protos}, num_classes, like=z0)

                def align(x, yb, logits):
                    gap = F.mse_loss(rep.z.float(), table[yb])
                    return self.params.lam * (gap * rep.z.shape[1] if self.params.align_loss == "squared_l2" else gap)

            self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index, 1), params=body, batch_loss=align)
        sd = model.state_dict()
        for k in self.head_keys:
            store[k] = sd[k].detach().clone()
        protos = class_means(features_of(model, client.x_train, self.train.normalize), y)
        counts = torch.bincount(y, minlength=num_classes).float()
        return {
            **{k: sd[k].detach() for k in self.body_keys + self.head_keys},
            **to_payload(protos),
            STATS + "v": v, STATS + "h": h, STATS + "counts": counts,
        }

    # --- the server
    def aggregate(self, server: State, uploads: list[tuple[ClientData, State]], rnd: int) -> State:
        if not uploads:
            return server
        body = RunningMean()
        for c, up in uploads:
            body.add(c.n_train, {k: up[k] for k in self.body_keys})
        out: State = {**{k: v for k, v in server.items() if k.startswith(HEAD)}, **body.result()}
        # global prototypes: each class's count-weighted mean over the clients that have it
        sums: dict[int, torch.Tensor] = {}
        weights: dict[int, float] = {}
        for _, up in uploads:
            for c, p in from_payload(up).items():
                w = float(up[STATS + "counts"][c])
                sums[c] = sums.get(c, 0) + w * p.double()
                weights[c] = weights.get(c, 0.0) + w
        out.update(to_payload({c: (sums[c] / weights[c]).float() for c in sorted(sums)}))
        # classifier collaboration: a combined classifier per uploader (Eq. 10)
        variances = [float(up[STATS + "v"]) for _, up in uploads]
        means = [up[STATS + "h"] for _, up in uploads]
        for i, (c, up) in enumerate(uploads):
            alpha = combination_weights(variances, means, i, self.params.min_weight, self.params.eig_floor)
            if alpha is None:
                log.warning("fedpac round %d: no solution of the combination QP for client %s; it keeps its own classifier", rnd, c.name)
                alpha = np.eye(len(uploads))[i]
            total = float(alpha.sum())
            for k in self.head_keys:
                mixed = sum(float(a) / total * uploads[j][1][k].double() for j, a in enumerate(alpha) if a > 0)
                out[f"{HEAD}{c.index}::{k}"] = mixed.to(up[k].dtype)
        return out

    # --- evaluation
    def eval_download(self, server, client):
        return self.download(server, client, 0)  # the extractor and the site's own combined head: no other site's

    def eval_state(self, server, store, client):
        combined = self._head_for(server, client)
        return {**{k: server[k] for k in self.body_keys}, **{k: combined.get(k, store[k]) for k in self.head_keys}}


__all__ = ["FedPAC", "FedPACParams", "combination_weights", "statistics"]
