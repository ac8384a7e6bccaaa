"""Helpers that several exercises' checks share, in one place: state snapshots (:mod:`.state`), the
words for how a process ended (:mod:`.wording`). A helper used by one exercise stays in its module;
one a second exercise needs moves here."""
