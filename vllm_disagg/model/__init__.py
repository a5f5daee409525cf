"""Models for testing real vLLM offline; torch and transformers are imported only when one is built."""
