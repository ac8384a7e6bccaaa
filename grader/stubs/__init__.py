"""Generated copies of exercises/*.py, for `ddp-grade reset` and `ddp-grade list`: do not edit.

`python -m grader.docs --write` adds the stubs missing here from exercises/, and `--stub NN` replaces
one (never with a file a learner has worked on); a test fails when they are out of step.
"""
