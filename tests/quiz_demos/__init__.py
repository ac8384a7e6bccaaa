"""Demonstrations of the quiz bank's claims on the installed torch (one module per topic).

A package, so that its modules are imported as ``quiz_demos.test_<topic>`` and never clash with a
test module of the same name elsewhere in ``tests/``; the ranks import their drivers by that name.
"""
