"""The agent: one per engine; launches or attaches to it, scrapes its metrics, reports to the orchestrator."""
