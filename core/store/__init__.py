"""The job store: every table (tables.py) and the queries beside them, one module per subject; each state
change is one conditional UPDATE. The database is the source of truth."""
