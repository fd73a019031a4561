"""Alias of :mod:`coda.runtime.keys` (moved into the runtime layer, issue 27): importing this module yields that
module object itself, so attributes set on either are the same."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("coda.runtime.keys")
