"""The exit codes of every ``ddp-grade`` command, the one table (documented in the command line's docstring,
grader/cli/__init__.py, and in docs/guarantees.md). Plain constants: the data layer (grader.results) reads them without click."""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNUSABLE = 2
EXIT_TIMEOUT = 3
EXIT_INTERRUPTED = 130
