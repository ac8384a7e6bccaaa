"""`python -m grader` is the same as `ddp-grade`."""

from grader.cli import main

main()
