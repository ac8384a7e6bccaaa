"""``python -m grader.worker``: the one worker entry point (see :mod:`grader.protocol`)."""

from grader.protocol import main

if __name__ == "__main__":
    main()
