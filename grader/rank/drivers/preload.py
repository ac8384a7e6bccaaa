"""Every exercise's drivers, imported: what the warm process pool preloads (grader.grading.warm_up)."""

import importlib
import pkgutil

import grader.rank.drivers

for _module in pkgutil.walk_packages(grader.rank.drivers.__path__, "grader.rank.drivers."):
    if not _module.name.endswith(".preload"):
        importlib.import_module(_module.name)
