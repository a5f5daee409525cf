"""Pickers: choose one candidate from the weighted totals, with randomness from the request id."""
