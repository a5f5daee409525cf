"""Scheduling: the contract (``framework``) and the schedulers that implement it."""
