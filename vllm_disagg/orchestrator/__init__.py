"""The orchestrator: OpenAI gateway, instance registry, scheduler, agent control plane, admin API."""
