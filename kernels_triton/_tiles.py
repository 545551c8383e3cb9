"""The SM12x tile tables live in ``_common``; this module re-exports them under their first names."""

from ._common import (  # noqa: F401
    KINDS, PREPASS_MIN_M, SM12X_SM_COUNTS, SM12X_SMEM_PER_BLOCK, TileConfig, sm12x_config, sm12x_entries,
)
