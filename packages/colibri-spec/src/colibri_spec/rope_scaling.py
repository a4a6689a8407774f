"""RopeScaling: how a config stretches RoPE's frequencies past the pre-training context (the
`rope_scaling` field of ColibriConfig, CHECKPOINT.md). The frequencies themselves are computed
in colibri_model.layers (`rope_inv_freq`); this module holds the validated parameters and the two yarn
factors derived from them."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

# The keys RopeScaling gained with "yarn" (1.2): written only for a yarn scaling, so a linear or
# llama3 scaling is the same JSON object as under 1.1.
_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


class RopeScaling(BaseModel):
    """Rotary frequency scaling for a longer context than the model was pre-trained on.

    - "linear": every frequency divided by `factor` (position interpolation).
    - "llama3": Llama 3.1's rule: wavelengths below `original_max_seq_len / high_freq_factor`
      unchanged, above `original_max_seq_len / low_freq_factor` divided by `factor`, a smooth
      interpolation between.
    - "yarn" (1.2): YaRN, as DeepSeek-V2/V3 use it: frequencies that turn fewer than `beta_slow`
      times over `original_max_seq_len` are divided by `factor`, more than `beta_fast` times kept,
      a linear ramp between (over the rotary dims, rounded outwards when `truncate`); cos and sin
      are multiplied by `attention_factor` and multi-head latent attention multiplies its softmax
      scale by `softmax_scale_factor` (both from `mscale`, `mscale_all_dim`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["linear", "llama3", "yarn"]
    factor: float = Field(gt=0)
    low_freq_factor: float | None = Field(None, gt=0)
    high_freq_factor: float | None = Field(None, gt=0)
    original_max_seq_len: int | None = Field(None, gt=0)
    beta_fast: float | None = Field(None, gt=0)
    beta_slow: float | None = Field(None, gt=0)
    mscale: float | None = Field(None, ge=0)
    mscale_all_dim: float | None = Field(None, ge=0)
    truncate: bool | None = None

    @model_validator(mode="after")
    def _check_kind(self) -> RopeScaling:
        llama3 = (self.low_freq_factor, self.high_freq_factor)
        yarn = tuple(getattr(self, key) for key in _YARN_KEYS)
        if self.kind == "llama3":
            if None in llama3 or self.original_max_seq_len is None:
                raise ValueError("rope_scaling: llama3 needs low_freq_factor, high_freq_factor, original_max_seq_len")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("rope_scaling: high_freq_factor must exceed low_freq_factor")
        elif self.kind == "yarn":
            if self.original_max_seq_len is None or any(v is not None for v in llama3):
                raise ValueError("rope_scaling: yarn needs original_max_seq_len and takes no low/high_freq_factor")
            if self.beta_fast is None or self.beta_slow is None or self.truncate is None:
                raise ValueError("rope_scaling: yarn needs beta_fast, beta_slow and truncate")
        elif any(v is not None for v in llama3 + (self.original_max_seq_len,)):
            raise ValueError(f"rope_scaling: {self.kind} takes only factor")
        if self.kind != "yarn" and any(v is not None for v in yarn):
            raise ValueError(f"rope_scaling: {', '.join(_YARN_KEYS)} are yarn's; {self.kind} takes none")
        return self

    @model_serializer(mode="wrap")
    def _without_yarn_keys(self, handler):
        data = handler(self)
        if self.kind != "yarn":
            for key in _YARN_KEYS:
                data.pop(key, None)
        return data

    @staticmethod
    def _yarn_mscale(factor: float, mscale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin (1 unless yarn)."""
        if self.kind != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return self._yarn_mscale(self.factor, self.mscale) / self._yarn_mscale(self.factor, self.mscale_all_dim)
        return self._yarn_mscale(self.factor, 1.0)

    @property
    def softmax_scale_factor(self) -> float:
        """DeepSeek's correction of the attention softmax scale under yarn (1 otherwise)."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        return self._yarn_mscale(self.factor, self.mscale_all_dim) ** 2
