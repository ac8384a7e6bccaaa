"""Every exercise's drivers, one module each (``exNN_slug.py``): what each rank runs to call the learner's code
and record what happened, and the inputs it builds from what the grader hands it; what several exercises'
drivers share is in :mod:`.shared`. The checks that decide are the grader's, in :mod:`grader.checks`.

Importing this package imports none of them: a rank imports its exercise's module, and the warm process
pool imports :mod:`.preload` (every module) once, so that no rank imports one itself.
"""
