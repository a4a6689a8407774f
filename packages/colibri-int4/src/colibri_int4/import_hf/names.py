"""The HF tensor names are colibri-spec's (`colibri_spec.hf_config.names`); re-exported here."""

from colibri_spec.hf_config.names import IGNORED, LlamaStyleNames

__all__ = ["IGNORED", "LlamaStyleNames"]
