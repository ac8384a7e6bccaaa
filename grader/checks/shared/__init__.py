"""Helpers that several exercises' checks share, in one place: a learner's exception as the grader reads it
(:mod:`.learner_errors`), DTensor records read against their placements (:mod:`.dtensors`), the debugging
track's jobs read and replayed (:mod:`.debug_job`, :mod:`.debug_replay`, :mod:`.fsdp_job`), 41-43's cases and
measurements (:mod:`.capacity_cases`), what data parallelism must reach, trained outside the ranks
(:mod:`.data_parallel`), timelines into the report. A helper used by one exercise stays in its
checks; one a second exercise needs moves here."""
