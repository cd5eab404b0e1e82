"""Sharing (pFedDIL's multi-task baseline): one shared trunk, one classifier head per domain."""

from __future__ import annotations

import torch

from fedsilo.client.local import predict
from fedsilo.methods.base import MeanAggregation, MethodParams, payload_bytes
from fedsilo.methods.continual import fedavg_update, head_keys, put, take
from fedsilo.models import LayeredNet


class MultiHead(MeanAggregation):
    """pFedDIL Sec. 4.1, "Sharing": all layers before the last fully connected layer are shared by every domain, and
    each domain has its own last layer; "during inference, the fully-connected layer that matches the corresponding
    domain ID will be applied". One FedAvg federation trains the trunk through the whole stream; at each task's
    first round the server adds a head for the new domain from the run's initial head parameters (kept as
    ``head<t>.``). A sampled client downloads the trunk with the current task's head, trains both for E epochs on the
    task's data and uploads them; the server averages the trunk and the current head. Task j's test images are scored
    with the trunk and head j. Clients keep nothing."""

    name = "multihead"
    params_cls = MethodParams
    task_stream = True
    stream_only = True

    def setup(self, model: LayeredNet) -> None:
        self.head = set(head_keys(model))
        self._init = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def init_server(self, model):
        return {k: v.clone() for k, v in self._init.items() if k not in self.head}

    def init_client(self, model, client):
        return {}

    def on_task_start(self, server, model, task):
        server = dict(server)
        put(server, f"head{task}.", {k: self._init[k] for k in self.head})
        return server

    def _model_for(self, server, task: int):
        trunk = {k: v for k, v in server.items() if not k.startswith("head")}
        return {**trunk, **take(server, f"head{task}.")}

    def download(self, server, client, rnd):
        return self._model_for(server, self.task)

    def local_update(self, model, store, payload, client, rnd, seed):
        return fedavg_update(self, model, payload, client, rnd, seed)

    def agg_end(self, server, acc, rnd):
        if acc.weight == 0:
            return server
        mean = acc.result()
        server = {**server, **{k: v for k, v in mean.items() if k not in self.head}}
        put(server, f"head{self.task}.", {k: mean[k] for k in self.head})
        return server

    def eval_state(self, server, store, client):
        return self._model_for(server, self.task)

    def storage(self, server, store):
        """One trunk and a head per domain seen."""
        trunk = {k: v for k, v in server.items() if not k.startswith("head")}
        heads = sum(payload_bytes(take(server, f"head{t}.")) for t in range(self.task + 1))
        return {"models": 1, "bytes": payload_bytes(trunk) + heads}

    def predict_task(self, model, server, store, client, task, rnd) -> torch.Tensor:
        model.load_state_dict(self._model_for(server, task), strict=True)  # the domain's own head
        return predict(model, client.x_test, cfg=self.train).softmax(1)
