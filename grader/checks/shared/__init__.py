"""Helpers that several exercises' checks share, in one place: what a driver records (:mod:`.recording`,
:mod:`.learner_errors`), the models the grader keeps from the stubs, the debugging track's jobs, 41-43's
measured runs. A helper used by one exercise stays in its checks; one a second exercise needs moves here."""
