"""Personal models: FedAvg on the server plus a personal model per client that never leaves it (Ditto, pFedSD,
FedeCouple)."""

from __future__ import annotations

from fedsilo.methods.base import State
from fedsilo.methods.sharing import PartialSharing
from fedsilo.models import LayeredNet

PERSONAL = "personal::"


class PersonalModels(PartialSharing):
    """The server runs FedAvg over the whole model; each client also keeps a personal model in its store under
    ``personal::`` keys (private: the engine refuses them in an upload). A client is evaluated with its personal
    model, or with the global model while its store is empty (a method whose ``init_client`` leaves it so); the global
    model is reported as well."""

    def shared_keys(self, model: LayeredNet) -> list[str]:
        return list(model.state_dict().keys())

    def setup(self, model: LayeredNet) -> None:
        super().setup(model)
        self.keys = list(model.state_dict().keys())

    def private_keys(self, model: LayeredNet) -> set[str]:
        return {PERSONAL + k for k in model.state_dict()}

    def personal(self, store: State) -> State:
        return {k: store[PERSONAL + k] for k in self.keys}

    def keep_personal(self, store: State, state: State) -> None:
        for k, v in state.items():
            store[PERSONAL + k] = v.detach().clone()

    def eval_state(self, server, store, client):
        return self.personal(store) if store else dict(server)

    def global_state(self, server):
        return dict(server)

    def eval_is_global(self):
        return False
