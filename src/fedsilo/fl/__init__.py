"""The engine and the stage runners: rounds, sampling, payloads, evaluation, checkpoints (``engine``); the train and
onboard stages (``run``, ``onboard``); the params a stage reads, with every method entry validated (``params``);
task streams (``continual``); Flower's apps (``flower``); a deployment across hospitals: its federation, App, status
and audit (``deploy``), its credentials (``credentials``), its parties' commands and services (``services``), a
site's card (``site``), a site's model on new images (``predict``, ``evaluate``)."""
