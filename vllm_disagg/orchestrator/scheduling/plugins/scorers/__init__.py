"""Scorers: rate every candidate in [0, 1], higher is better; the profile weights and sums them."""
