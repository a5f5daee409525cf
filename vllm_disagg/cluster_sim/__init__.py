"""The cluster simulator: a discrete-event model of many engines on a virtual clock, whose every
routing, planning and recovery decision is taken by the orchestrator's own code (docs/sim.md,
"Cluster simulator"). One process, no sleeping: 1,024 instances in minutes."""
