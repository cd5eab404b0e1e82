"""Source-only (pFedDIL's lower bound): the first task's model, kept fixed for the rest of the stream."""

from __future__ import annotations

from fedsilo.methods.base import MethodParams
from fedsilo.methods.fedavg import FedAvg


class SourceOnly(FedAvg):
    """pFedDIL Sec. 4.1: "the initial model trained on the initial domain data completely fixed throughout all tasks".
    During the first task it is FedAvg (a sampled client downloads the global model, trains E epochs, uploads it; the
    server takes the sample-size-weighted mean). From the second task on nothing is downloaded, trained or uploaded,
    and every task's test set is scored with the first task's global model."""

    name = "source_only"
    params_cls = MethodParams
    task_stream = True
    stream_only = True

    def download(self, server, client, rnd):
        return super().download(server, client, rnd) if self.task == 0 else {}

    def local_update(self, model, store, payload, client, rnd, seed):
        if self.task > 0:  # the source model is final: the client does nothing
            self.last_loss = None
            return {}
        return super().local_update(model, store, payload, client, rnd, seed)
