"""fedsilo: harmonized multi-site imaging data and personalized federated learning, tracked end to end.

Importing the package tells the libraries it drives not to reach the network on their own: MLflow's usage telemetry
(it looks up config.mlflow-telemetry.io when a run is logged), albumentations' version check (pypi.org, on import),
DVC's analytics (for the ``dvc`` processes fedsilo starts; the repository's ``.dvc/config`` also turns off DVC's
analytics and update check for ``dvc`` run by hand) and Flower's telemetry. fedsilo itself reaches only the addresses
a user names (a source's download, a deployment's SuperLink). A value already set in the environment is kept.
"""

from __future__ import annotations

import os as _os

#: environment variables set (unless already set) when fedsilo is imported, each keeping a library off the network
NO_PHONE_HOME = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "NO_ALBUMENTATIONS_UPDATE": "1",
    "DVC_NO_ANALYTICS": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
}
for _name, _value in NO_PHONE_HOME.items():
    _os.environ.setdefault(_name, _value)
