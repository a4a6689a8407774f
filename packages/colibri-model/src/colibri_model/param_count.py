"""Parameter counts live in colibri-spec; re-exported here for `colibri_model.param_count` imports."""

from colibri_spec import count_params, mla_params

__all__ = ["count_params", "mla_params"]
