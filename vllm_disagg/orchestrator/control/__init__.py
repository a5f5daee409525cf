"""Control of agents: the control plane (their sessions, commands and acknowledgements), and what is
done through it: KV moves between pools, role changes, rollouts and agents the orchestrator spawns."""
