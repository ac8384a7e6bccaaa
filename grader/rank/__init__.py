"""The rank side: what a rank needs to run and call the learner's code, and nothing that knows an answer.

The only package of the kit a sandbox shows (with ``grader/__init__.py``): the process that runs
the ranks inside it (:mod:`.rank_host`, :mod:`.harness`, :mod:`.processes`), what each rank runs
(:mod:`.child`, :mod:`.probes`, :mod:`.memory`, :mod:`.rank_timeline`), how what it did travels
(:mod:`.wire`, :mod:`.outcomes`), and the limits the ranks run under. A module here imports only
this package; references, expected values, verdicts and the cost models are the grader's, outside.
"""
