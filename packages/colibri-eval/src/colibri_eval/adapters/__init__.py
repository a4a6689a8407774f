"""Model adapters: turn ``hf:PATH``, ``colibri:PATH`` or ``int4:PATH`` into a ``LoadedModel``.

Each adapter imports its library only when asked for (``transformers``, ``colibri_model``,
``colibri_stream`` are extras), so ``import colibri_eval`` needs numpy/click/tqdm/pydantic
only. A ``LoadedModel`` bundles a tokenizer (``TextTokenizer``) and a ``TokenLogitsModel``;
the scoring engine is the same for all three.
"""

from __future__ import annotations

from colibri_eval.adapters.loaded_model import LoadedModel
from colibri_eval.errors import MissingDependencyError, ModelSpecError

__all__ = ["EXTRAS", "KINDS", "LoadedModel", "load_model", "parse_model_spec"]

KINDS = ("hf", "colibri", "int4")


def parse_model_spec(spec: str) -> tuple[str, str]:
    kind, sep, path = spec.partition(":")
    if not sep or kind not in KINDS or not path:
        raise ModelSpecError(f"bad --model {spec!r}: expected hf:PATH, colibri:PATH or int4:PATH")
    return kind, path


EXTRAS = {"hf": "hf", "colibri": "colibri", "int4": "colibri"}  # the extra each kind of model needs
_ARTICLE = {"hf": "an", "colibri": "a", "int4": "an"}


def _missing(kind: str, exc: ImportError) -> MissingDependencyError:
    return MissingDependencyError.from_import_error(f"{_ARTICLE[kind]} {kind}: model", EXTRAS[kind], exc)


def load_model(spec: str, dtype: str = "float32", ram_budget: str | None = None) -> LoadedModel:
    """Load a model from its spec; raises ``ModelSpecError`` with one readable line, or
    ``MissingDependencyError`` naming the extra to install when the kind's libraries are absent."""
    kind, path = parse_model_spec(spec)
    try:
        if kind == "hf":
            from colibri_eval.adapters.hf_causal_lm import load_hf
            return load_hf(spec, path, dtype)
        if kind == "colibri":
            from colibri_eval.adapters.colibri_checkpoint import load_colibri
            return load_colibri(spec, path, dtype)
        from colibri_eval.adapters.int4_stream import load_int4
        return load_int4(spec, path, ram_budget, dtype)
    except ImportError as exc:
        raise _missing(kind, exc) from None
