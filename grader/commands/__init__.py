"""The logic behind the learner commands (list, hint, watch, solution, reset, interview, doctor)."""
