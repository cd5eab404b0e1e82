"""pFedDIL (Li et al., ECCV 2024): personalized federated domain-incremental learning by adaptive knowledge matching."""

from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import Field
from torch import nn

from fedsilo.client.data import ClientData, to_float
from fedsilo.client.local import make_generator, predict, train_local, use_bf16
from fedsilo.methods.base import Method, MethodParams, RunningMean, State, fresh_copy, payload_bytes
from fedsilo.methods.continual import has, head_input, put, take
from fedsilo.models import LayeredNet


class PFedDILParams(MethodParams):
    lam: float = Field(0.5, ge=0, description="lambda of Eq. 4: a new task reuses the personalized model whose knowledge "
                       "matching intensity is highest when that intensity reaches lambda, else starts a new model (0: always "
                       "reuse, one model; above 1: a new model per task)")
    migration: bool = Field(True, description="the knowledge migration loss of Eq. 5 (false: the ablation 'w/o Migration')")
    share_extractor: bool = Field(True, description="the auxiliary classifier shares every layer before the last fully "
                                  "connected one with the target model, Eq. 8 (false: 'w/o Sharing', a separate network)")
    correlation: bool = Field(True, description="weight the ensemble at inference by the auxiliary outputs, Eq. 6-7 "
                              "(false: 'w/o Correlation', equal weights)")
    migration_weight: float = Field(1.0, ge=0, description="factor on the migration loss (1 = Eq. 5 as printed)")
    aux_gradient: Literal["head", "trunk"] = Field(
        "head", description="with share_extractor, what the auxiliary loss (Eq. 3) trains: its own fully connected layer "
        "on the shared layers' features ('head': the paper's lambda = 0 is FedAvg, as its Table 6 and text say), or the "
        "shared layers too ('trunk': Eq. 8's joint loss read literally)")

    def unused_keys(self) -> set[str]:
        return set() if self.share_extractor else {"aux_gradient"}  # w/o Sharing: the auxiliary network trains alone


def confidence(aux_logits: torch.Tensor) -> torch.Tensor:
    """f(x; theta) in [0, 1] from the auxiliary classifier's logits: its largest softmax probability rescaled from
    [1/C, 1] to [0, 1] (0: no idea which class, 1: certain), so that lambda means the same for 10 and 31 classes."""
    c = aux_logits.shape[1]
    return ((aux_logits.softmax(1).amax(1) - 1.0 / c) / (1.0 - 1.0 / c)).clamp(0.0, 1.0)


SLOT, AUX = "slot", "aux"
WHO = "who."  # server state: the family each client trains in the current task, as its announce said


class PFedDIL(Method):
    """Alg. 1 of the paper, read with its Sec. 3.2. Each client keeps a set of *personalized models* (trunk + target
    classifier) with one *auxiliary classifier* each; a model serves one or several tasks. Nothing a client keeps is
    ever uploaded but the model it trains for the current task.

    **New task, first round a client takes part** (client side, ``announce``): with each of its models' auxiliary
    classifier it computes the *knowledge matching intensity* of the new task, the mean auxiliary output over the
    task's training images (Eq. 2), and picks a strategy (Eq. 4): reuse its model m with the highest intensity when
    that intensity reaches lambda, else start a new model from the initial parameters w-hat (Alg. 1 line 1). It tells
    the server which *family* it trains (a model started at task j is family j; a reused model keeps its family: the
    announcement is that one integer). **Every round**: the client
    trains from the server's current model of its family (w-hat for a family nobody has trained yet), for E epochs on the current task with the task loss, the auxiliary loss (Eq. 3: its fully connected
    layer on the shared layers' features, Eq. 8; see *Sharing* below) and the knowledge migration loss sum_i rho_i ||w - w_i||^2 towards each of its *other* models
    weighted by their intensities (Eq. 5); it keeps the result as its personalized model of that family with its
    auxiliary classifier, and uploads the model. **Server**: the sample-size-weighted mean of the uploads of each
    family. **Inference**: every model of the client predicts; the softmax outputs are weighted per image by the
    auxiliary outputs normalized to sum to 1 (Eq. 6-7). A client that has not yet trained holds w-hat only.

    Choices where the paper is open (the authors' code is not public):

    - *The auxiliary output.* The paper calls the auxiliary classifier binary ("does the sample belong to the task")
      but trains it by Eq. 3, cross entropy with the class labels y_i, on the task's data alone; a client keeps no
      images of other tasks, so a binary head would see one class only and answer "yes" to everything (every task
      would then reuse one model, whatever lambda). Here the auxiliary classifier is a second fully connected head over
      the classes trained by Eq. 3, and its output f(x; theta) is its confidence: the largest softmax probability
      rescaled from [1/C, 1] to [0, 1] (``confidence``), high on the domains it was trained on, lower under a domain
      shift, so that lambda keeps the paper's range whatever the number of classes (Table 6: lambda = 0 one model,
      lambda = 1 about one per task; the raw probability would make every lambda <= 1/C act as 0).
    - *Federation of personalized models.* Alg. 1 aggregates the uploaded models; clients whose strategies differ
      train different models, so the server averages per family, and a client's personalized model of a family is the
      federation's: every selected client trains from the server's current model of its family (Alg. 1, line 4),
      and after a task's last aggregation each client that took part receives the family model it trained
      (``task_end_download``, counted), which it keeps, reuses and migrates from; inside a task it is scored with the
      server's model of that family (its own copy is then its last local update). lambda = 0 with migration off is
      then FedAvg over one model (the paper's Table 6: lambda = 0 "degenerates to the normal FedAvg"), with the
      auxiliary classifier apart (``share_extractor: false``) or sharing the layers under ``aux_gradient: head`` (the
      default, below); under ``aux_gradient: trunk`` the auxiliary loss trains the shared layers as well and lambda = 0
      differs from FedAvg. Tested to the score with migration off, under full and under partial participation for every client that has taken part in the task (a client not yet sampled in a
      task holds, and is scored with, the models it received last); lambda > 1 is a new federation per task
      ("separately train models for each domain with knowledge migration"). A family's auxiliary head stays the
      client's own (it is never uploaded) and is applied to the federation's trunk of that family.
    - *Sharing* (Sec. 3.2 and 4.1): every layer before the last fully connected layer is shared by the two heads; "w/o
      Sharing" gives the auxiliary classifier a network of its own (same architecture), trained by Eq. 3 alone.
      Whether the auxiliary loss also trains the shared layers the paper leaves two ways: Eq. 8 minimizes the sum of
      the two losses over both classifiers, the shared extractor included, while Sec. 4.1 says it trains "one
      additional fully connected layer as the auxiliary classifier", the text says lambda = 0 "will degenerate to the
      normal FedAvg algorithm", Algorithm 1 updates theta by Eq. 3 and w by Eq. 5 as two steps (lines 9-10), and the
      tables print exactly FedAvg's numbers for lambda = 0 (Table 6's 82.43, 33.35,
      45.32 are Tables 1-3's FedAvg Avg) and for the first task of every pFedDIL row with sharing (92.82, 46.53,
      48.43; only "w/o Sharing" differs, 92.79, 46.63, 48.52). A joint loss through the shared layers gives neither:
      on the quickstart's digit stream it scored lambda = 0 at 54.9 against FedAvg's 41.3 and raised the first task
      from 26.8 to 40.8 (one seed, a read-only audit, 2026-12-07). So the default, ``aux_gradient: head``, trains the
      auxiliary layer on the shared layers' features with their gradient stopped; ``trunk`` is Eq. 8 read literally.
    - *When the strategy is chosen*: Eq. 2 and Eq. 4 once per task, at the client's first round in it (the text: "when
      it comes to the new incremental task"); Algorithm 1 lists them (lines 5-6) inside the round loop, where
      recomputing them each round would let a client change model in the middle of a task.
    - *Task order*: every client meets the domains in the split's one order (the tables' columns name the tasks in one
      order; Fig. 1's caption has each client draw its own).
    - *Migration* anchors at the other models as they were when the task began (they are not trained during it);
      the intensities are those of Eq. 2 for this task. Eq. 5 sums over all d models of the client, the one being
      trained included; here the model a reused family continues is left out of the sum (a pull of w towards its
      own starting point would be a proximal term the paper does not describe, and the text calls migration
      knowledge taken from the *other* personalized models).
    """

    name = "pfeddil"
    params_cls = PFedDILParams
    params: PFedDILParams
    task_stream = True
    stream_only = True
    # what the server heard from each client this round is kept on the method
    client_parallel = False

    # ------------------------------------------------------------------ structure
    def setup(self, model: LayeredNet) -> None:
        self.keys = list(model.state_dict())
        self.weights = [n for n, _ in model.named_parameters()]
        self._init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        head = model.units[len(model.units) - model.head_units :]
        # the auxiliary classifier: a second last layer over the shared representation, or a network of its own
        base = nn.Sequential(*head) if self.params.share_extractor else model
        self.aux = fresh_copy(base, self.run_seed + 7919)
        self._aux_init = {k: v.detach().clone() for k, v in self.aux.state_dict().items()}
        self.heard: dict[int, int] = {}  # client index -> the family it trains this round

    def private_keys(self, model) -> set[str]:
        keys = {"route", "rho"}
        for j in range(len(self.tasks)):
            keys |= {f"{SLOT}{j}.{k}" for k in self.keys} | {f"{AUX}{j}.{k}" for k in self._aux_init}
        return keys

    def init_server(self, model):
        return {}

    def init_client(self, model, client):
        n = len(self.tasks)
        return {"route": torch.full((n,), -1, dtype=torch.int64), "rho": torch.full((n, n), float("nan"))}

    def slots(self, store: State) -> list[int]:
        """The families of the client's personalized models."""
        return [j for j in range(len(self.tasks)) if has(store, f"{SLOT}{j}.")]

    # ------------------------------------------------------------------ knowledge matching
    @torch.no_grad()
    def _outputs(self, model: LayeredNet, store: State, j: int, x_u8: torch.Tensor, batch_size: int = 256,
                 weights: Optional[State] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Model j's class probabilities and its auxiliary output f(x; theta_j) for uint8 images (``weights``: model j
        as the federation holds it, in place of the client's copy)."""
        model.load_state_dict(weights if weights is not None else take(store, f"{SLOT}{j}."), strict=True)
        self.aux.load_state_dict(take(store, f"{AUX}{j}."), strict=True)
        model.eval()
        self.aux.eval()
        bf16 = use_bf16(self.train, x_u8.device)
        probs, conf = [], []
        with head_input(model) as seen:
            for i in range(0, len(x_u8), batch_size):
                x = to_float(x_u8[i : i + batch_size], self.train.normalize)
                with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = model(x).float()
                    aux = self.aux(seen.z if self.params.share_extractor else x).float()
                probs.append(logits.softmax(1))
                conf.append(confidence(aux))
        return torch.cat(probs), torch.cat(conf)

    def intensities(self, model: LayeredNet, store: State, client: ClientData) -> dict[int, float]:
        """Eq. 2: for each personalized model, the mean auxiliary output over the new task's training images."""
        return {j: float(self._outputs(model, store, j, client.x_train)[1].mean()) for j in self.slots(store)}

    def announce(self, model, store, client, rnd):
        t = self.task
        first = int(store["route"][t]) < 0
        if first:  # Eq. 4, once per task: reuse the best-matching model or start a new one
            rho = self.intensities(model, store, client)
            for j, r in rho.items():
                store["rho"][t, j] = r
            best = max(rho, key=lambda j: (rho[j], -j)) if rho else None
            store["route"][t] = best if best is not None and rho[best] >= self.params.lam else t
        family = int(store["route"][t])
        # every selected client receives the federation's current model of its family (Algorithm 1, line 4), the
        # first round of a task too: its own copy dates from its last round with that family
        return {"family": torch.tensor([family], dtype=torch.int64)}

    def hear(self, client, said):
        self.heard[client.index] = int(said["family"][0])

    def download(self, server, client, rnd):
        family = self.heard[client.index]
        model = take(server, f"family{family}.")
        return model if model else dict(self._init)  # a family nobody has trained yet starts at w-hat

    # ------------------------------------------------------------------ local training
    def _migration(self, model: LayeredNet, store: State, family: int):
        """Eq. 5: sum over the client's other models i of rho_i ||w - w_i||^2 (the model's weights)."""
        t = self.task
        anchors = []
        device = next(model.parameters()).device  # the store may live on the host
        for j in self.slots(store):
            rho = float(store["rho"][t, j])
            if j == family or rho != rho or rho == 0:
                continue
            old = take(store, f"{SLOT}{j}.")
            anchors.append((rho * self.params.migration_weight, [old[n].to(device) for n in self.weights]))
        if not anchors or not self.params.migration or self.params.migration_weight == 0:
            return None
        live = dict(model.named_parameters())
        params = [live[n] for n in self.weights]

        def loss(_model: nn.Module) -> torch.Tensor:
            total = params[0].new_zeros(())
            for w, old in anchors:
                total = total + w * sum((p - o).pow(2).sum() for p, o in zip(params, old))
            return total

        return loss

    def local_update(self, model, store, payload, client, rnd, seed):
        family = int(store["route"][self.task])
        model.load_state_dict(payload if payload else take(store, f"{SLOT}{family}."), strict=True)
        aux_state = take(store, f"{AUX}{family}.")
        self.aux.load_state_dict(aux_state or self._aux_init, strict=True)
        migrate = self._migration(model, store, family)
        gen = make_generator(seed, rnd, client.index)
        if self.params.share_extractor:  # Eq. 8: task loss + auxiliary loss on the shared layers' features (+ Eq. 5)
            ce = nn.CrossEntropyLoss()
            self.aux.train()
            trunk = self.params.aux_gradient == "trunk"  # head: the auxiliary loss stops at the shared features
            with head_input(model) as seen:
                self.last_loss = train_local(
                    model, client, self.train, gen, extra_loss=migrate,
                    batch_loss=lambda x, y, logits: ce(self.aux(seen.z if trunk else seen.z.detach()), y),
                    params=[*model.parameters(), *self.aux.parameters()],
                )
        else:  # w/o Sharing: the target model (Eq. 1 + Eq. 5) and the auxiliary network (Eq. 3) apart
            self.last_loss = train_local(model, client, self.train, gen, extra_loss=migrate)
            train_local(self.aux, client, self.train, make_generator(seed, rnd, client.index, 1))
        put(store, f"{SLOT}{family}.", model.state_dict())
        put(store, f"{AUX}{family}.", self.aux.state_dict())
        return {k: v.detach() for k, v in model.state_dict().items()}

    # ------------------------------------------------------------------ server
    streaming = True

    def on_task_start(self, server, model, task):
        return {k: v for k, v in server.items() if not k.startswith(WHO)}  # a new task: every client chooses anew

    def agg_begin(self, server, rnd):
        return {"means": {}, "who": {}}

    def agg_add(self, acc, client, upload):
        family = self.heard[client.index]
        acc["means"].setdefault(family, RunningMean()).add(client.n_train, upload)
        acc["who"][client.index] = family

    def agg_end(self, server, acc, rnd):
        server = dict(server)
        for family, mean in acc["means"].items():
            put(server, f"family{family}.", mean.result())
        for index, family in acc["who"].items():
            server[f"{WHO}{index}"] = torch.tensor(family, dtype=torch.int64)
        self.heard.clear()
        return server

    def task_end_download(self, server, client):
        """After the task's last aggregation, a client that took part in the task receives the federation's model of
        the family it trained (its personalized model of that family from now on)."""
        family = server.get(f"{WHO}{client.index}")
        return take(server, f"family{int(family)}.") if family is not None else {}

    def task_end_keep(self, store, client, payload):
        family = int(store["route"][self.task])
        put(store, f"{SLOT}{family}.", payload)

    # ------------------------------------------------------------------ inference
    def ensemble(self, model: LayeredNet, store: State, x_u8: torch.Tensor,
                 server: Optional[State] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 6-7's parts for each image: the weights (models x images; the auxiliary outputs normalized to sum to
        1, or equal weights without correlation) and each model's class probabilities (models x images x classes).
        With ``server``, the family the client trains in the current task is the federation's model of it (what
        the client would receive: inside a task, the client's copy is its last local update)."""
        held: dict[int, State] = {}
        family = int(store["route"][self.task]) if server is not None else -1
        if family >= 0 and has(server, f"family{family}."):
            held[family] = take(server, f"family{family}.")
        outs = [self._outputs(model, store, j, x_u8, weights=held.get(j)) for j in self.slots(store)]
        probs = torch.stack([p for p, _ in outs])
        conf = torch.stack([c for _, c in outs])
        total = conf.sum(0, keepdim=True)
        # an image on which every auxiliary classifier is exactly uniform (total 0) weighs the models equally
        alpha = torch.where(total > 0, conf / total.clamp_min(1e-12), 1.0 / len(outs)) if self.params.correlation \
            else torch.full_like(conf, 1.0 / len(outs))
        return alpha, probs

    def predict_task(self, model, server, store, client, task, rnd) -> torch.Tensor:
        if not self.slots(store):  # never trained: the initial model is all the client has
            model.load_state_dict(self._init, strict=True)
            return predict(model, client.x_test, cfg=self.train).softmax(1)
        alpha, probs = self.ensemble(model, store, client.x_test, server)
        return (alpha.unsqueeze(2) * probs).sum(0)  # Eq. 7

    def eval_download(self, server, client):
        """The federation's family models: which family each site trains in the task (the server's ``who``) stays
        on the server."""
        return {k: v for k, v in server.items() if not k.startswith(WHO)}

    def eval_state(self, server, store, client):
        slots = self.slots(store)
        family = int(store["route"][self.task])
        return take(store, f"{SLOT}{family if family >= 0 else slots[-1]}.") if slots else dict(self._init)

    def storage(self, server: State, store: State) -> dict[str, int]:
        """What the client keeps (Table 6): its personalized models and their auxiliary classifiers."""
        kept = {k: v for k, v in store.items() if k.startswith((SLOT, AUX))}
        return {"models": len(self.slots(store)), "bytes": payload_bytes(kept)}

    def resolved(self) -> dict[str, Optional[int]]:
        return {"aux_params": int(sum(p.numel() for p in self.aux.parameters()))} if hasattr(self, "aux") else {}
