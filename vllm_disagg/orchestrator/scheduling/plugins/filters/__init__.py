"""Filters: keep the candidates that may serve the request in a profile (order preserved)."""
