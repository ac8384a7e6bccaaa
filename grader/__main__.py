"""`python -m grader` is the same as `ddp-grade`."""

from grader.commandline import main

main()
