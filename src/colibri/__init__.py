"""colibri: the app that composes the Colibri packages (relay-driven training, the demo)."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _metadata_version

try:  # the installed metadata is the one source of the version (pyproject.toml sets it)
    __version__ = _metadata_version("colibri")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
