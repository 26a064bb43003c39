"""The schedule stage: fused TIR kernels -> scheduled kernels (``schedules.pipeline``: rules in one declared
order; tuning logs in ``schedules.logs``, their database in ``schedules.database``)."""
