"""MLA's cost model lives in colibri-spec; re-exported here for `colibri_model.mla_cost` imports."""

from colibri_spec import MLA_FORMS, MlaForm, cheaper_mla_form, mla_form_flops, most_decompressed_keys

__all__ = ["MLA_FORMS", "MlaForm", "cheaper_mla_form", "mla_form_flops", "most_decompressed_keys"]
