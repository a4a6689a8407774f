"""The seven zero-shot tasks, with lm-evaluation-harness 0.4's prompts, requests and gold.

Each ``Task`` turns one dataset row (HF field names) into a ``TaskItem``: the
(context, continuation) string pairs lm-eval would send to ``LM.loglikelihood``, the choice
strings whose character lengths ``acc_norm`` divides by, and the gold index. The rules are
copied from lm-eval 0.4.9's task YAMLs and ``api/task.py`` (``construct_requests``,
``process_results``), zero-shot, no description, no chat template:

- multiple choice: one request per choice, ``(doc_to_text, " " + choice)`` (the target
  delimiter " " starts each continuation);
- winogrande is "multiple input" (partial scoring): one context per option (the sentence up
  to the blank with the option filled in) and ONE shared continuation (" " + the rest after
  the blank, stripped); the gold comes from ``answer`` ("1"/"2");
- lambada_openai is a single loglikelihood request: context = all words but the last joined
  by " ", continuation = " " + last word (no extra delimiter for this output type);
- hellaswag's ``process_docs``: ``preprocess(activity_label + ": " + ctx_a + " " +
  ctx_b.capitalize())`` and ``preprocess`` on each ending.

Token-level rules (trailing space moves into the continuation, continuation tokens =
tok(ctx+cont)[len(tok(ctx)):], empty context -> BOS/EOS) live in ``request_encoding.py``.
Trade-off: the prompts are plain Python, not jinja templates, so they are fast and readable but
must be kept in step with lm-eval by hand; the parity test in tests/ catches drift.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from colibri_eval.errors import FieldError, UnknownTaskError

TARGET_DELIMITER = " "


@dataclass(frozen=True)
class TaskItem:
    """One document's requests and what is needed to score them."""

    requests: list[tuple[str, str]]
    choices: list[str]
    gold: int
    # lm-eval's ``doc_to_choice`` strings; ``acc_norm`` divides by their character lengths.


@dataclass(frozen=True)
class Task:
    name: str
    version: str
    output_type: str  # "multiple_choice" | "loglikelihood"
    metrics: tuple[str, ...]
    hf_path: str
    hf_name: str | None
    hf_split: str
    full_size: int
    # field name -> expected python type (dict/list/str/int); checked before building requests
    fields: dict[str, type]
    build: Callable[[dict[str, Any]], TaskItem]


def _choice_requests(context: str, choices: list[str], gold: int) -> TaskItem:
    requests = [(context, f"{TARGET_DELIMITER}{choice}") for choice in choices]
    # lm-eval marks an out-of-range gold as -100 (never correct) and warns.
    return TaskItem(requests, list(choices), gold if 0 <= gold < len(choices) else -100)


def _label_index(labels: list[str], key: str) -> int:
    if key not in labels:
        raise FieldError(f"answerKey {key!r} is not one of choices.label {labels}")
    return labels.index(key)


def _build_lambada(doc: dict[str, Any]) -> TaskItem:
    words = doc["text"].split(" ")
    context = " ".join(words[:-1])
    continuation = " " + words[-1]
    return TaskItem([(context, continuation)], [], 0)


def _build_piqa(doc: dict[str, Any]) -> TaskItem:
    return _choice_requests(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(doc["label"]))


def _build_arc(doc: dict[str, Any]) -> TaskItem:
    choices = doc["choices"]
    gold = _label_index(list(choices["label"]), doc["answerKey"])
    return _choice_requests(f"Question: {doc['question']}\nAnswer:", list(choices["text"]), gold)


def _build_openbookqa(doc: dict[str, Any]) -> TaskItem:
    choices = doc["choices"]
    gold = _label_index(list(choices["label"]), doc["answerKey"].lstrip())
    return _choice_requests(doc["question_stem"], list(choices["text"]), gold)


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag ``preprocess``, in its order: strip FIRST, then drop tags (so a raw
    ending that starts with a tag keeps a leading space)."""
    text = text.strip()
    # Brackets are artifacts of the WikiHow part of HellaSwag.
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def _build_hellaswag(doc: dict[str, Any]) -> TaskItem:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    query = hellaswag_preprocess(doc["activity_label"] + ": " + ctx)
    endings = [hellaswag_preprocess(ending) for ending in doc["endings"]]
    label = str(doc["label"])
    if not label.isdigit():
        raise FieldError(f"label {doc['label']!r} is not a digit string")
    return _choice_requests(query, endings, int(label))


def _build_winogrande(doc: dict[str, Any]) -> TaskItem:
    sentence = doc["sentence"]
    if "_" not in sentence:
        raise FieldError("sentence has no '_' blank")
    blank = sentence.index("_")
    answer_to_index = {"1": 0, "2": 1}
    if str(doc["answer"]) not in answer_to_index:
        raise FieldError(f"answer {doc['answer']!r} is not '1' or '2'")
    contexts = [sentence[:blank] + option for option in (doc["option1"], doc["option2"])]
    continuation = sentence[blank + 1 :].strip()
    requests = [(context, f"{TARGET_DELIMITER}{continuation}") for context in contexts]
    return TaskItem(requests, contexts, answer_to_index[str(doc["answer"])])


_CHOICES = dict  # {"text": [...], "label": [...]}

TASKS: dict[str, Task] = {
    task.name: task
    for task in [
        Task("lambada_openai", "1.0", "loglikelihood", ("perplexity", "acc"),
             "EleutherAI/lambada_openai", "default", "test", 5153,
             {"text": str}, _build_lambada),
        Task("piqa", "1.0", "multiple_choice", ("acc", "acc_norm"),
             "baber/piqa", None, "validation", 1838,
             {"goal": str, "sol1": str, "sol2": str, "label": int}, _build_piqa),
        Task("winogrande", "1.0", "multiple_choice", ("acc",),
             "winogrande", "winogrande_xl", "validation", 1267,
             {"sentence": str, "option1": str, "option2": str, "answer": str}, _build_winogrande),
        Task("arc_easy", "1.0", "multiple_choice", ("acc", "acc_norm"),
             "allenai/ai2_arc", "ARC-Easy", "test", 2376,
             {"question": str, "choices": _CHOICES, "answerKey": str}, _build_arc),
        Task("arc_challenge", "1.0", "multiple_choice", ("acc", "acc_norm"),
             "allenai/ai2_arc", "ARC-Challenge", "test", 1172,
             {"question": str, "choices": _CHOICES, "answerKey": str}, _build_arc),
        Task("openbookqa", "1.0", "multiple_choice", ("acc", "acc_norm"),
             "openbookqa", "main", "test", 500,
             {"question_stem": str, "choices": _CHOICES, "answerKey": str}, _build_openbookqa),
        Task("hellaswag", "1.0", "multiple_choice", ("acc", "acc_norm"),
             "hellaswag", None, "validation", 10042,
             {"activity_label": str, "ctx_a": str, "ctx_b": str, "endings": list, "label": str},
             _build_hellaswag),
    ]
}

ALL_TASKS = tuple(TASKS)


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UnknownTaskError(f"unknown task {name!r}; known tasks: {', '.join(ALL_TASKS)}")
    return TASKS[name]


def parse_task_list(spec: str) -> list[Task]:
    """``"all"`` or a comma-separated list of task names, in the order given."""
    if spec.strip() == "all":
        return [TASKS[name] for name in ALL_TASKS]
    names = [part.strip() for part in spec.split(",") if part.strip()]
    if not names:
        raise UnknownTaskError("empty task list; pass 'all' or names like 'piqa,hellaswag'")
    return [get_task(name) for name in names]


def check_fields(task: Task, doc: Any) -> None:
    """Raise ``FieldError`` naming the first missing or mistyped field."""
    if not isinstance(doc, dict):
        raise FieldError(f"row is a {type(doc).__name__}, expected a JSON object")
    for name, kind in task.fields.items():
        if name not in doc:
            raise FieldError(f"missing field {name!r} for task {task.name}")
        value = doc[name]
        # HF presents some labels as int and others as str; accept both where lm-eval would.
        if kind is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            continue
        if kind is str and isinstance(value, int) and name in ("label", "answer"):
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise FieldError(f"field {name!r} is {type(value).__name__}, expected {kind.__name__}")
    for name, kind in task.fields.items():
        if kind is dict:
            value = doc[name]
            for sub in ("text", "label"):
                if not isinstance(value.get(sub), list):
                    raise FieldError(f"field {name!r} lacks a list {sub!r}")
        if kind is list and not all(isinstance(x, str) for x in doc[name]):
            raise FieldError(f"field {name!r} must be a list of strings")


def build_item(task: Task, doc: dict[str, Any]) -> TaskItem:
    check_fields(task, doc)
    return task.build(doc)
