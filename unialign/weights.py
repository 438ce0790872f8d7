"""Loaded weights checked at load: a checkpoint holding NaN / inf is refused there, by path and tensor name,
instead of surfacing steps later as a sampling error (``probability tensor contains inf / nan``) or a NaN loss.

``check_finite(module, source)``: one ``torch.isfinite(t).all()`` pass over every floating-point parameter and
buffer (large tensors in chunks, so the check allocates at most ``CHUNK`` bools at a time; meta tensors of a
lazily placed model are skipped). Called by the text and diffusion loaders on what they load.
"""

from __future__ import annotations

import itertools

import torch

from unialign.config import UserError

CHUNK = 1 << 24  # elements per isfinite call


def first_nonfinite(module: torch.nn.Module) -> tuple[str, int, int] | None:
    """(name, non-finite values, values) of the first parameter or buffer of ``module`` holding NaN / inf, in
    ``named_parameters()`` then ``named_buffers()`` order; None when all are finite."""
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if t is None or t.device.type == "meta" or not (t.is_floating_point() or t.is_complex()):
            continue
        flat = t.detach().reshape(-1)
        if not all(bool(torch.isfinite(part).all()) for part in flat.split(CHUNK)):
            bad = sum(int((~torch.isfinite(part)).sum()) for part in flat.split(CHUNK))
            return name, bad, flat.numel()
    return None


def check_finite(module: torch.nn.Module, source: str, part: str | None = None) -> None:
    """Raise ``UserError`` (one line: the model path, the part, the first bad tensor) when ``module``'s
    weights hold NaN or inf."""
    found = first_nonfinite(module)
    if found is None:
        return
    name, bad, total = found
    where = f"model {source!r}" + (f" ({part})" if part else "")
    raise UserError(f"{where}: weight {name!r} holds {bad} NaN / inf values of {total}; the checkpoint is damaged "
                    "(re-download or re-save it) or was saved after training diverged")
