"""`count_host_syncs`: the conversions that would make the host wait for the device, counted on CPU."""

from __future__ import annotations

import os
import traceback

import torch


HOST_SYNC_OPS = frozenset({
    "__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy",
    "equal", "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",
    "allclose", "is_nonzero",
})


class count_host_syncs(torch.overrides.TorchFunctionMode):
    """Context manager: records every `HOST_SYNC_OPS` call made inside it (this thread).

    ``calls`` lists ``(op name, "file:line" of the caller)``. On a GPU each is a host
    synchronisation; on CPU they are the same calls, so a CPU test can prove a path
    makes none. ``repeat_interleave`` without ``output_size`` is counted too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                     and len(args) > 1 and isinstance(args[1], torch.Tensor)):
            self.calls.append((name, _caller()))
        return func(*args, **kwargs)


def _caller() -> str:
    """The innermost stack frame outside torch and this module, as "file:line"."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("testing.py"):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"
