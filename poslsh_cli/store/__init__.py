"""Run storage: one owner per run directory (``ownership``), a cell's work directory with its
log and checkpoints (``cellwork``), the run directory its owner writes (``rundir``) and what
readers read from it without writing (``readers``).
"""
