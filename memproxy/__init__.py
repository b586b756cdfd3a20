"""memproxy: an OpenAI-compatible proxy that remembers each conversation."""

__version__ = "0.1.0"
