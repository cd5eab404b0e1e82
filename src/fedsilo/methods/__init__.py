"""FL methods: one module per method (a subpackage where a method brings its own model and protocol), registered by
name in :mod:`fedsilo.methods.registry`. Shared machinery sits in a few base modules:

- ``base``: the hooks the engine calls (:class:`Method`), typed params (a value per backbone), the running mean,
  payload sizes;
- ``sharing``: partial sharing (a fixed subset of the state_dict shared, the rest kept on the client; heads and
  top layers; F²DC's modules on any such method);
- ``phased``: the two-phase protocol (local phase, then federation);
- ``personal``: a personal model per client beside a FedAvg global model;
- ``prototypes``: class prototypes computed on the client, sent, clustered (FPL, FedTGP, FedSA, FedPAC, FedeCouple);
- ``decoupling``: F²DC's feature decoupler and corrector as a model unit;
- ``channels``: a per-layer split of output channels into private and shared (CD2-pFed);
- ``continual``: the methods of a stream of domain tasks (heads per task, the classifier's input);
- ``terms``: proximal and distillation terms of local objectives.
"""

from fedsilo.methods.base import Method, MethodParams
from fedsilo.methods.registry import REGISTRY, check_methods, method_base, method_class, method_params, resolve_method

__all__ = ["Method", "MethodParams", "REGISTRY", "check_methods", "method_base", "method_class", "method_params", "resolve_method"]
