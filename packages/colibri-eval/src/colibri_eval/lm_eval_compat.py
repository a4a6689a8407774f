"""Importing lm-eval in this environment, and lm-eval task YAMLs over local JSONL files.

``import_lm_eval()``: lm-eval 0.4.9's ``models/hf_vlms.py`` reads
``transformers.AutoModelForVision2Seq`` at import time, a name transformers 5 removed (its
successor is ``AutoModelForImageTextToText``), so ``import lm_eval`` fails outright. We alias
the old name before importing. NOTE: importing ``evaluate`` replaces
``sys.modules["transformers"]`` with a fresh lazy module, so the alias is set on whatever
module is registered after ``evaluate`` is imported.

``write_local_task_yamls()``: for parity checks we want lm-eval's OWN task definitions
(prompts, ``!function`` hooks, metrics) reading our JSONL files. Each generated YAML
``include``s the installed lm-eval task YAML and overrides only the data source
(``dataset_path: json`` + ``data_files``) and the splits, so nothing about the prompts is
restated here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from colibri_eval.tasks import TASKS

# lm-eval 0.4 task YAML of each task, relative to lm_eval/tasks/
LM_EVAL_TASK_YAML = {
    "lambada_openai": "lambada/lambada_openai.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
}
LOCAL_PREFIX = "colibri_local_"


def import_lm_eval() -> ModuleType:
    try:
        import evaluate  # noqa: F401, PLC0415 - must come first, see module docstring
    except ImportError:
        pass
    try:
        import transformers  # noqa: F401, PLC0415
    except ImportError:
        pass
    module = sys.modules.get("transformers")
    if module is not None and "AutoModelForVision2Seq" not in vars(module):
        try:
            module.AutoModelForVision2Seq = module.AutoModelForImageTextToText
        except AttributeError:
            pass
    import lm_eval  # noqa: PLC0415

    # NOTE: from lm-eval 0.4.10 the model registry fills lazily, and only while it is empty: once
    # our `colibri` type is registered, `hf` and the other built-ins would never be found. Load
    # the built-in table first (a no-op on 0.4.9, which registers them on import).
    import lm_eval.models  # noqa: F401, PLC0415

    return lm_eval


def lm_eval_tasks_dir() -> Path:
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        raise ImportError("lm-eval is not installed (pip install 'colibri-eval[lm-eval]')")
    return Path(spec.origin).parent / "tasks"


def write_local_task_yamls(data_dir: str | Path, out_dir: str | Path, tasks: list[str] | None = None) -> dict[str, str]:
    """Write ``colibri_local_TASK.yaml`` files; return {task: local lm-eval task name}."""
    data = Path(data_dir).resolve()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = {}
    for name in tasks or list(TASKS):
        task = TASKS[name]
        upstream = lm_eval_tasks_dir() / LM_EVAL_TASK_YAML[name]
        split = task.hf_split
        local = LOCAL_PREFIX + name
        splits = {"training_split": "null", "validation_split": "null", "test_split": "null"}
        splits["test_split" if split == "test" else "validation_split"] = split
        lines = [
            f"include: {upstream}",
            f"task: {local}",
            "tag: []",
            "dataset_path: json",
            "dataset_name: null",
            "dataset_kwargs:",
            "  data_files:",
            f"    {split}: {data / (name + '.jsonl')}",
            *(f"{key}: {value}" for key, value in splits.items()),
        ]
        (out / f"{local}.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
        names[name] = local
    return names
