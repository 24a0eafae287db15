"""tamer: train LLM agents with reinforcement learning from verifiable feedback."""

__version__ = "0.1.0"
