"""Validation of stored tuning results: moved to :mod:`coda.runtime.rules` (issue 27); this name stays an alias."""
from coda.runtime.rules import config_problem, result_entry_problem  # noqa: F401
