"""`LoadedModel`: what every adapter returns, a tokenizer and a model that scores tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoadedModel:
    spec: str  # what the user passed, e.g. "hf:/models/smollm2"
    kind: str
    path: str
    tokenizer: Any  # TextTokenizer
    model: Any  # TokenLogitsModel
    info: dict[str, Any] = field(default_factory=dict)  # dtype, parameters, revision...
