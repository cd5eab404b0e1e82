"""FedRep: federated representation learning with personal heads (Collins, Hassani, Mokhtari and Shakkottai, ICML
2021, "Exploiting shared representations for personalized federated learning")."""

from __future__ import annotations

from pydantic import Field

from fedsilo.client.local import make_generator, train_local
from fedsilo.methods.base import ClientWeights, client_weights_field
from fedsilo.methods.fedper import FedPer, FedPerParams
from fedsilo.methods.sharing import frozen, head_and_body


class FedRepParams(FedPerParams):
    head_epochs: int = Field(10, ge=1, description="tau_h: epochs on the client's head with the representation fixed (the code's local_ep)")
    body_epochs: int = Field(1, ge=1, description="tau: epochs on the representation with the head fixed (the code's local_rep_ep)")
    client_weights: ClientWeights = client_weights_field("uniform", "uniform is the paper's Algorithm 1 and its code's on "
                                                         "image data; samples is FedAvg's (FedPAC's protocol)")


class FedRep(FedPer):
    """Collins et al. 2021, Algorithm 1. The model is a global representation phi (the body, every weighted layer
    but the top ``head_layers``) and a head h_i per client that never leaves it. Each round a sampled client
    downloads phi^t, then (1) trains its own head for tau_h epochs with the representation fixed, (2) trains the
    representation for tau epochs with its new head fixed, and uploads phi; the server takes the mean of the
    uploaded representations, each sampled client alike (the paper's 1/(rn) sum, and the code's on CIFAR and MNIST,
    whose ``lens`` are ones; it weighs by sample count on the LEAF data only): ``client_weights: uniform``, the
    default; ``samples`` weighs by training-set size, as FedPAC's code, whose protocol FedeCouple follows, weighs every
    method (FedeCouple's presets set it). Clients are evaluated with phi plus their own head (FedPer's split and
    evaluation; FedRep differs in the alternating local schedule, which is what the tests pin down).

    Defaults are the authors' run scripts' (github:lgcollins/FedRep): 10 head epochs, then 1 representation epoch (5
    on CIFAR-100 there: ``body_epochs``), head = the last linear layer (``main_fedrep.py``'s argument defaults
    differ: its ``local_ep`` counts both phases). Each phase gets a
    fresh SGD optimizer over its own parameters (``train`` gives lr, momentum, weight decay, batch size); the fixed
    part gets no gradient (``frozen``), while BatchNorm statistics, where the backbone has BatchNorm (the paper's CNNs do
    not), follow the batches of both phases as they do in the code's train-mode loops. ``train.local_epochs`` is not
    used: the two phases give the epochs. The code's weight decay skips biases; ``train.weight_decay`` here applies to
    every parameter. The code's final round of head-only fine-tuning after the last
    aggregation is not part of this schedule."""

    name = "fedrep"
    joinable = True  # one global (or shared) state and per-client stores only: a site may join mid-run
    params_cls = FedRepParams
    params: FedRepParams

    def local_update(self, model, store, payload, client, rnd, seed):
        self.load_round(model, store, payload)
        head, body = head_and_body(model, self.cut)
        with frozen(body):  # (1) the head, representation fixed
            train_local(model, client, self.train, make_generator(seed, rnd, client.index, 0), epochs=self.params.head_epochs, params=head)
        with frozen(head):  # (2) the representation, head fixed
            self.last_loss = train_local(model, client, self.train, make_generator(seed, rnd, client.index, 1),
                                         epochs=self.params.body_epochs, params=body)
        return self.keep_and_share(model, store)
