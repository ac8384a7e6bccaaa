"""PLACEHOLDER (the lead's, so that grader.checks imports): replace this whole file with the real rank side."""


def measure_main(ctx) -> dict:
    raise NotImplementedError("measure_main is not written yet")
