"""Internal, going away: ``ftlib.lora.layers`` still imports DoRA's row norm through this module.

The math and its one home is ``ftlib.kernels.dora_ref`` (``ftlib.lora`` re-exports ``dora_row_norm`` /
``dora_row_norm_direct`` from there); delete this file once ``layers.py`` imports ``..kernels.dora_ref``.
"""

from ftlib.kernels.dora_ref import dora_row_norm, row_sq_norm

__all__ = ["dora_row_norm", "row_sq_norm"]
