"""FedBABU: federated body aggregation, body update, head fine-tuned at evaluation (Oh, Kim and Yun, ICLR 2022,
"FedBABU: toward enhanced representation for federated image classification")."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, PositiveInt
from torch import nn

from fedsilo.client.local import make_generator, train_local
from fedsilo.config import ConfigError
from fedsilo.methods.base import ClientWeights, MethodParams, State, client_weights_field, per_backbone_type
from fedsilo.methods.sharing import PartialSharing, frozen, per_backbone, top_units, unit_prefixes
from fedsilo.models import LayeredNet


class FedBABUParams(MethodParams):
    head_layers: per_backbone_type(PositiveInt) = Field(
        1, description="weighted layers at the top that form the head (fixed at its initialisation); a mapping backbone "
        "-> count for one methods block serving several backbones",
    )
    finetune_epochs: int = Field(5, ge=0, description="tau_f: epochs each client fine-tunes the whole global model before it is evaluated (0 = no fine-tuning)")
    finetune_lr: float = Field(1e-3, gt=0, description="fine-tuning learning rate (the code's personalization lr)")
    finetune_momentum: float = Field(0.9, ge=0, lt=1, description="fine-tuning momentum (the code's)")
    client_weights: ClientWeights = client_weights_field("samples", "samples is the paper's Algorithm 1 (n_i / n), "
                                                         "uniform its code's mean over the sampled clients")


class FedBABU(PartialSharing):
    """Oh et al. 2022, Algorithm 1. During federated training the head (the top ``head_layers`` weighted layers) is
    never trained: it keeps its random initialisation, the same on every client, so it never travels. Each sampled
    client downloads the global body, trains only the body for E epochs (``train``) with the head fixed, and uploads
    it; the server averages the bodies by sample size (the paper's n_i / n; the code's plain mean over the sampled
    clients, the same on its equal shards, is ``client_weights: uniform``). To evaluate, every client fine-tunes the whole global model
    (body and head) on its own training data for ``finetune_epochs`` and is evaluated with the result; the
    fine-tuned model is thrown away (each evaluation starts again from the global model, as the paper's
    personalization does after training). The global model (body + initial head) is reported as well.
    FedeCouple's related work says FedBABU "fine-tunes the classifier locally"; its paper and code fine-tune body and
    head, as here.

    Choices where the paper is open follow the authors' code (github:jhoon-oh/FedBABU): fine-tuning with SGD lr 1e-3,
    momentum 0.9, 5 epochs, the training batch size, no augmentation beyond ``train.augment``; the head is frozen
    by keeping it out of the optimizer (the code sets its learning rate to 0; the same update). The head is the top
    ``head_layers`` weighted layers' units without their normalization layers (every other parameter of those units:
    Linear and convolution weights and biases, a ViT block's attention projections), as the code's head is the parameters named ``linear``: a
    normalization layer among or below them (DenseNet's ``norm5`` in its top unit, the
    BatchNorm1d between Simple-CNN's fully connected layers) is body, trained and averaged with its statistics (the
    code's CIFAR net tracks no running statistics); frozen at its initialisation it would normalize with mean 0 and
    variance 1 at every evaluation. The fine-tuning batches
    are seeded by (seed, round, client), so evaluating changes no later number.

    Not copied from the code: its fine-tuning starts from the round with the best *test* accuracy (``best_model.pt``:
    a selection on the test set; here the evaluated round's global model), and its federated training divides the
    learning rate by 10 at T/2 and 3T/4: that is ``train.lr_schedule: {kind: step, gamma: 0.1, milestones: [T/2,
    3T/4]}``, which the presets leave constant: every method of a table trains at the table's one rate (FedBABU's
    own text, which may state the decay, could not be read here). In the code the fine-tuning rate 1e-3 is where its
    training rate (0.1, decayed twice) ends; at a constant training rate it is a smaller step than there relative to
    training (1/20 of the FedeCouple presets' 0.02), so FedBABU's personalization may be understated beside the code's:
    ``finetune_lr`` set to the table's training rate keeps the code's end-of-training ratio instead."""

    name = "fedbabu"
    joinable = True  # one global (or shared) state and per-client stores only: a site may join mid-run
    params_cls = FedBABUParams
    params: FedBABUParams

    def shared_keys(self, model: LayeredNet) -> list[str]:
        what = f"methods.{self.key}.head_layers"
        layers = per_backbone(self.params.head_layers, self.train.model, what)
        cut = top_units(model, layers, what)
        head = unit_prefixes(cut, len(model.units))
        norms = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
        self.head_names = {f"{name}.{p}" if name else p for name, mod in model.named_modules()
                           if f"{name}.".startswith(head) and not isinstance(mod, norms)
                           for p, _ in mod.named_parameters(recurse=False)}
        if not self.head_names:
            raise ConfigError(f"{what}: the top {layers} layers of this backbone "
                              "hold no parameter outside normalization layers")
        return [key for key in model.state_dict() if key not in self.head_names]

    def local_update(self, model, store, payload, client, rnd, seed):
        self.load_round(model, store, payload)
        head = [p for n, p in model.named_parameters() if n in self.head_names]
        body = [p for n, p in model.named_parameters() if n not in self.head_names]
        with frozen(head):  # body update, head fixed at its initialisation
            self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index), params=body)
        sd = model.state_dict()
        return {key: sd[key].detach() for key in self.shared}  # the store (the initial head) is unchanged

    def newcomer_refusal(self) -> str:
        if self.params.finetune_epochs:
            return ""
        return ("with finetune_epochs 0 every site is evaluated with the global body and the initial head: a site holds "
                "nothing of its own to adapt (score the federation's model as it is)")

    def load_eval_model(self, model, server, store, client, rnd):
        super().load_eval_model(model, server, store, client, rnd)  # the global body + the initial head
        if self.params.finetune_epochs == 0:
            return
        # the code's fine-tuning: SGD with its own rate and momentum, whatever the local training's optimizer
        tune = self.train.model_copy(update={"optimizer": "sgd", "nesterov": False, "lr": self.params.finetune_lr,
                                             "momentum": self.params.finetune_momentum, "weight_decay": 0.0})
        train_local(model, client, tune, make_generator(self.run_seed, rnd, client.index, 2), epochs=self.params.finetune_epochs)

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        sd = model.state_dict()  # the freshly initialised model: its head is every client's, for good
        self.initial_head = {k: sd[k].detach().clone() for k in self.private}

    def global_state(self, server: State) -> Optional[State]:
        return {**self.initial_head, **server}
