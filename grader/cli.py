"""``ddp-grade`` (and ``python -m grader``): the command line. Its group and its commands, one module each,
with every click decorator of the kit, are in :mod:`grader.commandline`."""

from grader.commandline import main

__all__ = ["main"]
