"""pFedDB: its dual-branch model (``model``), the method under the two-phase protocol (``method``) and the onboarding
of a newcomer domain after training (``onboarding``, the paper's Fig. 6)."""

from fedsilo.methods.pfeddb.method import PFedDB, PFedDBParams
from fedsilo.methods.pfeddb.model import DualBranch, Fusion, closest_to_70

__all__ = ["PFedDB", "PFedDBParams", "DualBranch", "Fusion", "closest_to_70"]
