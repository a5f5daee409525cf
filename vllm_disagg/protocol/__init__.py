"""Typed, versioned messages between orchestrator and agents, their codec and transport."""
