"""The host tier: pinned host slots (``slots``), their bookkeeping (``tier``) and the copy engines
that move pages between the device and the slots (``copy_engine``). Nothing here imports a
secondary tier."""
