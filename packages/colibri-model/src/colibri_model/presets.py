"""The presets live in colibri-spec; re-exported here for `colibri_model.presets` imports."""

from colibri_spec import PRESETS, get_preset

__all__ = ["PRESETS", "get_preset"]
