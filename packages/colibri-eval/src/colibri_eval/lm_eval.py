"""``python -m colibri_eval.lm_eval ARGS``: lm-eval's own CLI with the ``colibri`` model type.

lm-eval 0.4 discovers models only from its own package, so a plugin cannot make the plain
``lm_eval --model colibri`` command work; this wrapper applies the transformers-5 import
shim (see lm_eval_compat.py), registers ``colibri`` and hands ``sys.argv`` to
``lm_eval.__main__.cli_evaluate`` unchanged. Console script: ``colibri-lm-eval``.

``--version`` prints this wrapper's and lm-eval's versions. Exit status, as for every Colibri
command: 0 ok, 1 a check failed, 2 bad usage or bad input; lm-eval not installed (or a
``colibri`` model whose libraries are missing) is one line naming the extra, exit 2.
"""

from __future__ import annotations

import sys

PROG = "colibri-lm-eval"


def _version_line() -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    from colibri_eval import __version__  # noqa: PLC0415

    try:
        lm_eval_version = version("lm-eval")
    except PackageNotFoundError:
        lm_eval_version = "not installed (pip install 'colibri-eval[lm-eval]')"
    return f"{PROG} (colibri-eval {__version__}), lm-eval {lm_eval_version}"


def _asks_for_help(args: list[str]) -> bool:
    """Whether lm-eval's parser will only print help: -h/--help before any `--`, no arguments, or a
    bare `run` (lm-eval prints the run help for that)."""
    options = args[:args.index("--")] if "--" in args else args
    return not args or args == ["run"] or "-h" in options or "--help" in options


def _help_without_models() -> bool:
    """Print lm-eval's help from its parser alone (lm-eval >= 0.4.10 has `lm_eval._cli`), without
    the model registry, transformers or torch: seconds less. False where that parser is missing."""
    try:
        # first: 0.4.9 has no _cli, and its __main__ imports the evaluator (torch) to build a parser
        import lm_eval._cli  # noqa: F401, PLC0415
        from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415
    except ImportError:
        return False
    cli_evaluate()
    return True


def main() -> None:
    from colibri_eval.errors import ColibriEvalError, MissingDependencyError  # noqa: PLC0415

    if sys.argv[1:2] == ["--version"]:
        print(_version_line())
        return
    if _asks_for_help(sys.argv[1:]) and _help_without_models():
        return
    try:
        from colibri_eval.lm_eval_compat import import_lm_eval  # noqa: PLC0415

        try:
            import_lm_eval()
            from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

            import colibri_eval.lm_eval_model  # noqa: F401, PLC0415 - registers the "colibri" model type
        except ImportError as exc:
            raise MissingDependencyError.from_import_error(PROG, "lm-eval", exc) from None
        cli_evaluate()
    except ColibriEvalError as exc:  # e.g. --model_args model=int4:... without colibri-stream
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
