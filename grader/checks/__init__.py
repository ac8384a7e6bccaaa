"""Every exercise's checks, a module or a package each: ``grade(g)`` starts the runs of the exercise's
drivers (:mod:`grader.rank.drivers`) and decides each check in the grader's process, from what the ranks
sent and from references computed here.

Importing this package imports none of them: a grading imports its exercise's module alone.
"""
