"""DoRA's row norm ``||W + s B A||``: the math lives in ``ftlib.kernels.dora_ref`` (the fused kernels
use it); its public names are re-exported here for ``ftlib.lora`` users.
"""

from ftlib.kernels.dora_ref import RECOMPUTE_ROWS, dora_row_norm, dora_row_norm_direct, row_sq_norm

__all__ = ["RECOMPUTE_ROWS", "dora_row_norm", "dora_row_norm_direct", "row_sq_norm"]
