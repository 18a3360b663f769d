"""Foundations: configuration and its one validation (``config``), atomic and whole-directory
writes with fault points (``files``), the processes of a torchrun or SLURM job (``distributed``).
Imports nothing else of poslsh.
"""
