"""reins: harnessed agentic RL."""

__version__ = "0.1.0"
