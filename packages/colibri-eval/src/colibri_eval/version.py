"""The installed version of colibri-eval: the package metadata is its one source (pyproject.toml
sets it), so the results files and `--version` say the same."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _metadata_version

try:
    __version__ = _metadata_version("colibri-eval")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
