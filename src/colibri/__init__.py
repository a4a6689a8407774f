"""colibri: the app that composes the Colibri packages (relay-driven training, the demo)."""

__version__ = "0.2.0"
