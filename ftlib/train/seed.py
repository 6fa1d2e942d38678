"""Seeding every random stream a training process draws from: Python's, NumPy's legacy global and torch's.

``seed_everything(seed)`` sets ``random.seed(seed)``, ``np.random.seed(seed mod 2**32)`` and
``torch.manual_seed(seed)`` (which seeds the CPU generator and every CUDA device's). Give each
rank its own seed (``seed + rank``) when ranks must draw different dropout masks, the same one
when they must draw the same adapter initialisation.
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (legacy global) and torch's random generators with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
