"""FedLGF (Yan and Guo 2024, ECCV): local and global flatness through an adversarially perturbed classifier."""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from pydantic import Field
from torch import nn
from torch.func import functional_call

from fedsilo.client.local import make_generator
from fedsilo.methods.base import MethodParams, spare_copy
from fedsilo.methods.fedavg import FedAvg
from fedsilo.models import LayeredNet


class FedLGFParams(MethodParams):
    perturb: Literal["singular", "weight"] = Field(
        "singular", description="perturb the classifier's singular values (FedLGF's default) or its weights"
    )
    noise: Literal["normal", "uniform"] = Field("normal", description="distribution of the random starting perturbation")
    local_smooth: float = Field(0.1, ge=0, description="weight of the local flatness term")
    global_smooth: float = Field(0.1, ge=0, description="weight of the global flatness term")
    init_scale: float = Field(10.0, ge=0, description="radius of the random perturbation (rho_0)")
    grad_scale: float = Field(0.1, ge=0, description="radius of the adversarial perturbation (rho)")


class FedLGF(FedAvg):
    """FedLGF (Yan and Guo 2024, ECCV, "Local and Global Flatness for Federated Domain Generalization"), from the
    paper and the authors' code (github.com/cnyanhao/FedLGF, algorithm ``FedSVD``).

    FedAvg whose local objective adds two flatness terms computed on the classifier g (the backbone's head):
    CE + a_l * KL(p(g~_local(z)) || p(g(z))) + a_g * KL(p(g~_global(z_G)) || p(g(z))), where z are the local
    features (detached), z_G the downloaded global model's features of the same batch, and g~ a classifier whose
    linear layers carry an adversarial perturbation: for W = U diag(S) V^T, a random unit direction d on the singular
    values gives S' = relu(S + rho_0 d); the gradient of KL(p(g(z)) || p(g_{S'}(z))) with respect to d, normalized
    to unit length, gives the adversarial direction, and g~ uses S'' = relu(S + rho * grad) (``perturb: weight``
    perturbs W itself row by row instead). The perturbed predictions are targets (no gradient flows through them).
    The global model is evaluated on every client.

    Choices: the defaults are the authors' published command (singular values, normal noise, a_l = a_g = 0.1,
    rho_0 = 10, rho = 0.1). The global model runs in evaluation mode, its head too (running statistics); BatchNorm
    layers inside the local head (DenseNet's final norm) use batch statistics in its perturbed passes without
    touching the running statistics. The random
    directions come from the run's seeded generator (seed, round, client)."""

    name = "fedlgf"
    joinable = True  # one global model and per-client stores only: a site may join mid-run
    # the feature hook writes the current batch's features onto the method
    client_parallel = False
    task_stream = False  # not one of the continual papers' baselines
    params_cls = FedLGFParams
    params: FedLGFParams

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        self.head_start = len(model.units) - model.head_units
        self._features: list[torch.Tensor] = []
        self._capture = False
        self._global: Optional[LayeredNet] = None

        def keep(_module: nn.Module, inputs: tuple) -> None:
            if self._capture:
                self._features[:] = [inputs[0]]

        # registered before the engine compiles the model; it records the head's input (the features z)
        model.units[self.head_start].register_forward_pre_hook(keep)

    def _perturbed(self, head: nn.Sequential, z: torch.Tensor, clean: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        p = self.params
        linears = [n for n, m in head.named_modules() if isinstance(m, nn.Linear)]
        weights = {n: head.get_submodule(n).weight.detach().float() for n in linears}
        z, clean = z.detach().float(), clean.detach().float()

        def noise(shape: torch.Size) -> torch.Tensor:
            r = torch.randn(shape, generator=gen) if p.noise == "normal" else torch.rand(shape, generator=gen) - 0.5
            return r.to(z.device)

        def unit(d: torch.Tensor) -> torch.Tensor:
            """Unit length: the whole singular-value vector, or each row of a weight."""
            return d / (d.norm() + 1e-8) if p.perturb == "singular" else d / (d.norm(dim=1, keepdim=True) + 1e-8)

        if p.perturb == "singular":
            svd = {n: torch.linalg.svd(w, full_matrices=False) for n, w in weights.items()}
            deltas = {n: unit(noise(svd[n][1].shape)) for n in linears}

            def perturb(scale: float, dirs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                out = {}
                for n, (u, s, vh) in svd.items():
                    out[f"{n}.weight"] = u @ torch.diag(torch.relu(s + scale * dirs[n])) @ vh
                return out
        else:
            deltas = {n: unit(noise(w.shape)) for n, w in weights.items()}

            def perturb(scale: float, dirs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                return {f"{n}.weight": weights[n] + scale * dirs[n] for n in linears}

        def forward(w: dict[str, torch.Tensor]) -> torch.Tensor:
            buffers = {n: b.clone() for n, b in head.named_buffers()}  # BatchNorm statistics stay untouched
            return functional_call(head, {**w, **buffers}, (z,))

        with torch.autocast(device_type=z.device.type, enabled=False), torch.enable_grad():
            for d in deltas.values():
                d.requires_grad_(True)
            out = forward(perturb(p.init_scale, deltas))
            kl = torch.nn.functional.kl_div(torch.log_softmax(out, 1), torch.softmax(clean, 1), reduction="batchmean")
            grads = torch.autograd.grad(kl, list(deltas.values()), allow_unused=True)
            dirs = {n: unit(torch.zeros_like(deltas[n]) if g is None else g) for n, g in zip(deltas, grads)}
            with torch.no_grad():
                return forward(perturb(p.grad_scale, dirs))

    def local_terms(self, model, payload, client, rnd, seed, store) -> dict[str, Any]:
        p = self.params
        gen = make_generator(seed, rnd, client.index, 2)
        head = nn.Sequential(*model.units[self.head_start :])
        glob_features: Optional[nn.Sequential] = None
        glob_head: Optional[nn.Sequential] = None
        if p.global_smooth > 0:
            if self._global is None:
                self._global = spare_copy(model)  # type: ignore[assignment]
            glob = self._global
            assert glob is not None
            glob.load_state_dict(payload, strict=True)
            glob.eval()
            glob_features, glob_head = glob.feature_extractor(), nn.Sequential(*glob.units[self.head_start :])

        def batch_loss(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            z = self._features[0]
            self._capture = False  # the perturbed passes below run the head again: keep this batch's features
            try:
                log_p = torch.log_softmax(logits.float(), 1)
                loss = logits.new_zeros((), dtype=torch.float32)
                if p.local_smooth > 0:
                    target = self._perturbed(head, z, logits, gen)
                    loss = loss + p.local_smooth * torch.nn.functional.kl_div(log_p, torch.softmax(target, 1), reduction="batchmean")
                if glob_features is not None and glob_head is not None:
                    with torch.no_grad():
                        zg = glob_features(x)
                    target = self._perturbed(glob_head, zg, logits, gen)
                    loss = loss + p.global_smooth * torch.nn.functional.kl_div(log_p, torch.softmax(target, 1), reduction="batchmean")
                return loss
            finally:
                self._capture = True

        return {"batch_loss": batch_loss}

    def local_update(self, model, store, payload, client, rnd, seed):
        self._capture = True
        try:
            return super().local_update(model, store, payload, client, rnd, seed)
        finally:
            self._capture = False
            self._features.clear()
