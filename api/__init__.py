"""Conveyor's HTTP surface: the FastAPI app, routes, schemas and auth. Stands on `core` alone."""
