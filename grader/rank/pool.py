"""Imported by the sandbox's warm pool (the forkserver its host starts) as the pool starts, and nowhere
else: it makes that process non-dumpable, as the host is (:mod:`grader.rank.rank_host`).

The pool holds the pipes on which the host learns each rank's pid and exit status, and the pipe that
tells it the host is alive: a rank that could open them through ``/proc/PID/fd`` could write any rank's
exit code, or end the pool. Each process forked from the pool makes itself dumpable again as it starts
(:func:`grader.rank.child.serve`): the host reads its ranks' ``/proc`` files, and a rank is the submission's
own process anyway.
"""

import ctypes

PR_SET_DUMPABLE = 4

if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
    raise SystemExit(f"the sandbox's pool cannot make itself non-dumpable (errno {ctypes.get_errno()})")
