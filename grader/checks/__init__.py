"""Every exercise's checks, a module or a package each: drivers that run in each rank, and checks that decide in
the grader.

Importing this package imports none of them: a grading imports its exercise's module alone, and
the warm process pool imports :mod:`grader.checks.preload` (every module) once, so that no rank
imports one itself.
"""
