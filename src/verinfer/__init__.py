"""verinfer: verify that LLM outputs came from the claimed model and inference configuration."""

__version__ = "0.1.0"
