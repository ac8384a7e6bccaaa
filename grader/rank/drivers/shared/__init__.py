"""What several exercises' drivers share, in one place: what a driver records (:mod:`.recording`,
:mod:`.learner_errors`, :mod:`.dtensors`), the models built from the stubs' own code (:mod:`.stub_models`),
the debugging track's job runner (:mod:`.debug_rank`), 41-43's measured runs and worker. A helper one
exercise's drivers use stays in its module; one a second exercise needs moves here."""
