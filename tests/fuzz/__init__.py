"""Bad peers: hypothesis fuzzing of the agent protocol and the OpenAI gateway of a real orchestrator."""
