"""The one tolerance helper every test uses: tight, dtype-aware, never loosened per test."""

from __future__ import annotations

import numpy as np
import torch

TOLERANCES = {  # (rtol, atol)
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-4),
}


def assert_close(actual, expected, dtype: torch.dtype | None = None, msg: str = "") -> None:
    """Compare a tensor with a tensor / numpy array / number at the tolerance of ``dtype``
    (default: ``actual``'s dtype)."""
    actual_t = actual if isinstance(actual, torch.Tensor) else torch.as_tensor(actual)
    dtype = dtype or actual_t.dtype
    rtol, atol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    expected_t = torch.as_tensor(np.asarray(expected)) if not isinstance(expected, torch.Tensor) else expected
    torch.testing.assert_close(
        actual_t.detach().cpu().to(torch.float64),
        expected_t.detach().cpu().to(torch.float64).reshape(actual_t.shape),
        rtol=rtol, atol=atol, msg=(lambda m: f"{msg}: {m}") if msg else None,
    )
