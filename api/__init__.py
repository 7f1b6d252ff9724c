"""Conveyor's HTTP surface and job store."""
