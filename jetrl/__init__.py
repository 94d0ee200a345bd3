"""jetrl: on-policy FP8 reinforcement learning for LLMs with one precision flow (Jet-RL)."""

__version__ = "0.1.0"
