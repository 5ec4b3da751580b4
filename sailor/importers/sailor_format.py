"""One entry point for every format of the original Sailor artifact.

``import_profiles`` (profiles + per-layer sizes → ProfileDB), ``import_network`` (zone
bandwidth fits → NetworkProfile), ``import_egress`` (egress prices → PriceTable),
``import_plan`` / ``export_plan`` (plan configs ↔ Plan), ``import_training_config`` (→ ModelSpec),
``import_pool`` and ``import_trace`` (quotas and availability traces → Pool).
"""

from sailor.importers._read import ImportFormatError
from sailor.importers.sailor_cluster import import_pool, import_trace, import_training_config
from sailor.importers.sailor_network import import_egress, import_network
from sailor.importers.sailor_plan import export_plan, import_plan, plan_from_dict
from sailor.importers.sailor_profiles import import_profiles, profile_models

__all__ = [
    "ImportFormatError",
    "export_plan",
    "import_egress",
    "import_network",
    "import_plan",
    "import_pool",
    "import_profiles",
    "import_trace",
    "import_training_config",
    "plan_from_dict",
    "profile_models",
]
