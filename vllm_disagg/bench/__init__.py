"""Benchmarks: each a `vllm-disagg bench` subcommand printing a table of medians."""
