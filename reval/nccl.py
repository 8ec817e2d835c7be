"""How this process's NCCL groups behave when a collective times out: one setting for every
NCCL group reval makes (the learner's FSDP group, ``learner/parallel.py``; the weight broadcast,
``reval/weights/collective.py``)."""

from __future__ import annotations

import os

NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
"""What a timed-out NCCL collective does, read when each NCCL group is constructed (torch 2.13
``torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp``: ``TORCH_NCCL_ASYNC_ERROR_HANDLING``,
``enum ErrorHandlingMode``). Its default, 3 (``SkipCleanUp``), makes the watchdog tear the whole
process down; 2 (``CleanUpOnly``) aborts the group's communicators and leaves the process, so the
failure surfaces as an exception (``DistBackendError``, a ``RuntimeError``) from the timed-out
work or the next collective on that group: the hub's ``sync`` catches it, drops the generation
and carries on; a learner rank ends through ``run_rank``'s ``finally`` and is restarted from its
checkpoint. A value the operator set is kept."""


def apply_nccl_env() -> None:
    """Set ``NCCL_ENV``'s defaults in this process's environment (before an NCCL group)."""
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
