"""The first names of the host helpers the e4m3 lessons share, now in ``_common`` (and
``grouped_tile`` in ``_codecs``); this module only re-exports them for callers not yet moved."""

from ._codecs import grouped_tile  # noqa: F401
from ._common import (  # noqa: F401
    BIAS_DTYPES, OUT_DTYPES, TileConfig, check_gemm_operands, e4m3_operand, flatten_rows, interpreter_config,
    quant_config,
)
