"""Generated copies of exercises/*.py, for `ddp-grade reset` and `ddp-grade list`: do not edit.

`python -m grader.docs --write` writes them from exercises/ (the one source); a test fails when
they are out of step.
"""
