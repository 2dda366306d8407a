"""Runs a DeepSpeed-style script (argv[1], with the rest of argv) after working around the
engine bug that test_deepspeed_script.py shows: the first ``from flowtrain.initialize import ...``
replaces the package attribute ``flowtrain.initialize`` (the function) with the submodule."""

import runpy
import sys

import flowtrain
import flowtrain.initialize as _module

flowtrain.initialize = _module.initialize  # the submodule is imported now; it is not set again
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
