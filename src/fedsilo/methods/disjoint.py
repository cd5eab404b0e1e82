"""Disjoint (pFedDIL's upper bound): one model per domain, chosen by the domain's identity at inference."""

from __future__ import annotations

import torch

from fedsilo.client.local import predict
from fedsilo.methods.base import MeanAggregation, MethodParams, payload_bytes
from fedsilo.methods.continual import fedavg_update, put, take
from fedsilo.models import LayeredNet


class Disjoint(MeanAggregation):
    """pFedDIL Sec. 4.1: "a separate model for each domain. During inference, the model which matches the
    corresponding domain ID is used". Each task starts a FedAvg federation of its own from the run's initial
    parameters (``on_task_start``; the server keeps task t's global model under ``task<t>.``): a sampled client
    downloads the current task's global model, trains E epochs on the task's data, uploads it; the server takes the
    sample-size-weighted mean. Task j's test images are scored with task j's model, so nothing is forgotten; the
    price is a model per domain and the domain's identity at inference. Clients keep nothing."""

    name = "disjoint"
    params_cls = MethodParams
    task_stream = True
    stream_only = True

    def setup(self, model: LayeredNet) -> None:
        # every task's starting point: the seeded initialisation (setup sees it again on a resumed run)
        self._init = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def init_server(self, model):
        return {}

    def init_client(self, model, client):
        return {}

    def on_task_start(self, server, model, task):
        server = dict(server)
        put(server, f"task{task}.", self._init)
        return server

    def download(self, server, client, rnd):
        return take(server, f"task{self.task}.")

    def local_update(self, model, store, payload, client, rnd, seed):
        return fedavg_update(self, model, payload, client, rnd, seed)

    def agg_end(self, server, acc, rnd):
        if acc.weight == 0:
            return server
        server = dict(server)
        put(server, f"task{self.task}.", acc.result())
        return server

    def eval_state(self, server, store, client):
        return take(server, f"task{self.task}.")

    def storage(self, server, store):
        """A model per domain seen: the client needs every one of them to answer every task."""
        return {"models": self.task + 1, "bytes": sum(payload_bytes(take(server, f"task{t}.")) for t in range(self.task + 1))}

    def predict_task(self, model, server, store, client, task, rnd) -> torch.Tensor:
        model.load_state_dict(take(server, f"task{task}."), strict=True)  # the domain's own model
        return predict(model, client.x_test, cfg=self.train).softmax(1)
