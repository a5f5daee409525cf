"""Deciders: choose disaggregated or colocated once the decode instance is known."""
