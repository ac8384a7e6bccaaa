"""Pristine copies of the exercise stubs, for `ddp-grade reset` and `ddp-grade list`.

Kept identical to exercises/ in the repository by tests/test_progress.py.
"""
