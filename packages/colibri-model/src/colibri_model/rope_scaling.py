"""RopeScaling lives in colibri-spec; re-exported here for `colibri_model.rope_scaling` imports."""

from colibri_spec import RopeScaling

__all__ = ["RopeScaling"]
