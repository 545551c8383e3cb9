"""The GEMM path policy (``gemm_path``, ``resolve_path``, device helpers) lives in ``_common``;
``is_sm90`` in ``kernels_triton.hopper``. This module re-exports them under their first names."""

from ._common import (  # noqa: F401
    A16_FORMATS, NATIVE_SCALE_LAYOUTS, PATHS, check_native_weight, default_device, device_capability, gemm_path,
    native_instruction, resolve_path, sm_count, weight_scale_bytes,
)
from ._common import _triton_version  # noqa: F401
from .hopper import is_sm90  # noqa: F401
