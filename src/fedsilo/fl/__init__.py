"""The engine and the stage runners: rounds, sampling, payloads, evaluation, checkpoints (``engine``); the train and
onboard stages (``run``, ``onboard``); the params a stage reads, with every method entry validated (``params``)."""
