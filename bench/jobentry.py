"""Kept so that Slurm jobs queued before run_job moved (issue 44) still unpickle by this
name; new jobs name its home, bench/launch/jobentry.py (submitit pickles functions by name)."""
from bench.launch.jobentry import run_job  # noqa: F401
