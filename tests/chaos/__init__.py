"""Chaos tests: failures injected into real processes, sockets and links."""
