"""Helpers the tests share: fixtures' machinery, fake runners, live servers and the fault suite's processes.

Imported as `tests.support.<module>` (the repository root is on sys.path through pytest's `pythonpath`), the
one name each has, so no helper is ever loaded twice under two names.
"""
