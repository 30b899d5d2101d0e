"""The host tier: the pinned host slots every chunk passes through, and the copies between them and
the device KV cache. Nothing here imports a secondary tier.

Each name has one home, imported from there:

* ``tier`` — :class:`HostTier`, the slot bookkeeping (which slot holds which chunk, pins, eviction);
* ``slots`` — :class:`SlotBuffer`, the host bytes themselves;
* ``copy_engine`` — :class:`CopyEngine`, the contract every copy engine keeps;
* ``copy_jobs`` — :class:`CopyJob`, :class:`CopyOrder`, :class:`CopyResult`: what it is handed and reports;
* ``copy_plan`` — :func:`plan_copies` and the :class:`CopyPlans` it builds: one :class:`CopyPlan` per
  page part of each KV-cache group, the layouts and views one rank's copies run between;
* ``cpu_copy`` / ``cuda_copy`` — :class:`CpuCopyEngine` / :class:`CudaCopyEngine` (and the copy routines it
  issues, :func:`copy_parts` picking one per part); ``completions`` — how the CUDA engine sees its copies finish;
* ``copy_factory`` — :func:`make_copy_engine`, the engine that fits a KV cache.
"""
