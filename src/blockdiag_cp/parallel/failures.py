"""A collective that fails inside a step, named: which one, called from where, in which step.

Note [A peer that dies mid-step]
--------------------------------
When a rank dies inside a training step (SIGKILL, the OOM killer, a lost node), its peers wait in the step's
collectives: the K/V exchange of an attention layer, its backward, the gradient all-reduce. Measured on gloo (CPU,
torch 2.13, the Trainer mixin at cp 2, tests/integrations/test_killed_rank.py): the surviving rank raises at once
(under 0.1 s after its peer died) with gloo's ``Connection closed by peer`` / ``Connection reset by peer``, from
``all_to_all_single`` deep inside the library; nothing in the message says which step of which run on which rank.
A peer that is alive but stuck (stopped, deadlocked) is noticed only when the process group's timeout expires
(``init_process_group(timeout=...)``; the Trainer's ``ddp_timeout``, which transformers does not pass on
``use_cpu=True`` runs: 30 minutes there), and the mesh's CP and dp groups keep the world group's timeout
(`inherit_world_timeout`).

`naming_collective_failures` re-raises such an error (one raised by a ``torch.distributed`` call, or a
``torch.distributed.DistError``) as a `CollectiveFailure` whose message names the collective, the library function
that called it, the step and the rank's place in the mesh, with the backend's message; the backend's exception is
its ``__cause__``. Every other error passes through unchanged. Under ``torchrun --max-restarts N`` the agent then
stops the other workers and restarts the group, which resumes from the last checkpoint (docs/trainer.md,
"Checkpoints and restarts").
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from datetime import timedelta
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..errors import CollectiveFailure

__all__ = ("naming_collective_failures", "inherit_world_timeout")

logger = logging.getLogger(__name__)

_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_LIBRARY = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@contextlib.contextmanager
def naming_collective_failures(where: Callable[[], str]) -> Iterator[None]:
    """Run the body; a collective that fails in it is re-raised as a `CollectiveFailure` naming it and ``where()``
    (e.g. "optimizer step 3 on rank 0 of 2 ..."; called only on failure). Note [A peer that dies mid-step]."""
    try:
        yield
    except CollectiveFailure:
        raise
    except RuntimeError as exc:
        message = _failure_message(exc, where)
        if message is None:
            raise
        raise CollectiveFailure(message) from exc


def _failure_message(exc: RuntimeError, where: Callable[[], str]) -> Optional[str]:
    """The `CollectiveFailure` message for `exc`, or None if `exc` did not come from a collective."""
    frames = traceback.extract_tb(exc.__traceback__)
    raised_in_dist = bool(frames) and _TORCH_DISTRIBUTED in frames[-1].filename
    if not (raised_in_dist or isinstance(exc, dist.DistError)):
        return None
    collective = f"torch.distributed.{frames[-1].name}" if raised_in_dist else type(exc).__name__
    callers = [f for f in frames if f.filename.startswith(_LIBRARY) and not f.filename.endswith("failures.py")]
    root = os.path.dirname(_LIBRARY.rstrip(os.sep))
    called = "".join(f", called from {f.name} ({os.path.relpath(f.filename, root)}:{f.lineno})"
                     for f in reversed(callers[-2:]))
    return (f"blockdiag-cp: {collective} failed in {where()}{called}. A peer rank of this collective died or did "
            f"not answer within the process group's timeout; the backend said: {str(exc).strip()}")


def inherit_world_timeout(mesh) -> None:
    """Give the process groups of `mesh`'s dimensions the timeout of the world group (torch makes a dimension's
    group with its backend's default, 30 minutes on gloo and 10 on NCCL, whatever timeout the world was started
    with); a dimension that is the world group already has it. Note [A peer that dies mid-step]."""
    world = dist.distributed_c10d._get_default_group()
    timeout = _group_timeout(world)
    if timeout is None:
        logger.warning("blockdiag-cp: the world process group's timeout cannot be read (torch %s); the mesh's CP and "
                       "dp groups keep torch's default timeout", torch.__version__)
        return
    for name in mesh.mesh_dim_names:
        group = mesh[name].get_group()
        if group is not world:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def _group_timeout(group) -> Optional[timedelta]:
    """The timeout of `group`'s backend (the one its collectives on this device wait for), None if unreadable."""
    device = next(iter(group._device_types), None)
    backend = None if device is None else group._get_backend(device)
    options = getattr(backend, "options", None)
    return getattr(options, "_timeout", None)
