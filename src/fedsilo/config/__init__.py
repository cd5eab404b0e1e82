"""params.yaml -> validated, typed configuration.

Every section is a pydantic model with ``extra="forbid"``: an unknown key or a bad value raises
:class:`ConfigError` whose message names the dotted key (``methods.fedprox.mu``) and what is wrong with it.
Method hyper-parameters are validated by the params class each method registers (``fedsilo.methods.registry``);
this package does not import the methods.

One module per part of the file, so that each stage's code dependency is what decides its output and no more:
``base`` (:class:`Strict`, :class:`ConfigError`), ``data`` (sources, datasets: the harmonize stages), ``split`` (the
split protocols: the split stages), ``train`` (an experiment's training: with ``base``, the params code every run's
code hash holds), ``errors`` (a params error's message) and ``pipeline`` (the whole file, a paper's too, its checks
across sections and its loaders). An edit of ``pipeline``, ``errors``, ``data`` or ``split`` retrains no run
(``fedsilo.codehash``); this file only gathers their names (``from fedsilo.config import TrainParams``).
"""

from fedsilo.config.base import *  # noqa: F403
from fedsilo.config.data import *  # noqa: F403
from fedsilo.config.errors import *  # noqa: F403
from fedsilo.config.pipeline import *  # noqa: F403
from fedsilo.config.split import *  # noqa: F403
from fedsilo.config.train import *  # noqa: F403
