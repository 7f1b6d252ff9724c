"""The job store: SQLAlchemy models and conditional state transitions. The database is the source of truth."""
