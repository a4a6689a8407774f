"""``python -m colibri_eval.lm_eval ARGS``: lm-eval's own CLI with the ``colibri`` model type.

lm-eval 0.4 discovers models only from its own package, so a plugin cannot make the plain
``lm_eval --model colibri`` command work; this wrapper applies the transformers-5 import
shim (see lm_eval_compat.py), registers ``colibri`` and hands ``sys.argv`` to
``lm_eval.__main__.cli_evaluate`` unchanged. Console script: ``colibri-lm-eval``.
"""

from __future__ import annotations


def main() -> None:
    from colibri_eval.lm_eval_compat import import_lm_eval  # noqa: PLC0415

    import_lm_eval()
    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

    import colibri_eval.lm_eval_model  # noqa: F401, PLC0415 - registers the "colibri" model type

    cli_evaluate()


if __name__ == "__main__":
    main()
