"""Imported by the warm pool (multiprocessing's forkserver) first, as it starts, and nowhere else: it makes
that process ignore Ctrl-C before the server looks at its handlers.

The server ignores SIGINT itself, but every process it forks starts with the handler the server found once
its preloads were imported: Python's, which raises KeyboardInterrupt. A Ctrl-C at the terminal reaches the
processes it forked while they are still in the command's process group, and one forked a moment earlier
had not yet reached its first line (:func:`grader.rank.child.serve`, which ignores it from there): its start
ended in a KeyboardInterrupt traceback on the command's terminal. Ignored here, every fork starts ignoring it;
a rank takes Python's handler again once it is in a process group of its own (:func:`grader.rank.child.main`).
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
