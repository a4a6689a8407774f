"""Prompt and request construction of the seven tasks (no model needed)."""

from __future__ import annotations

import pytest
from colibri_eval import ALL_TASKS, UnknownTaskError, get_task, load_documents, parse_task_list
from colibri_eval.tasks import build_item, hellaswag_preprocess


def test_task_list_parsing():
    assert [t.name for t in parse_task_list("all")] == list(ALL_TASKS)
    assert [t.name for t in parse_task_list("piqa, hellaswag")] == ["piqa", "hellaswag"]
    with pytest.raises(UnknownTaskError, match="unknown task 'mmlu'"):
        parse_task_list("piqa,mmlu")


def test_hellaswag_preprocess_strips_before_removing_tags():
    assert hellaswag_preprocess("  How to cook [title] Boil water.  ") == "How to cook. Boil water."
    # lm-eval strips first, so a leading tag leaves a leading space behind
    assert hellaswag_preprocess("[header] Use soap [step] then rinse") == " Use soap then rinse"


def test_hellaswag_query_and_endings():
    doc = {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
           "endings": ["is using wrap.", "starts pulling [title] up roofing."], "label": "1"}
    item = build_item(get_task("hellaswag"), doc)
    assert item.requests[0] == ("Roof shingle removal: A man is sitting on a roof. He", " is using wrap.")
    assert item.choices[1] == "starts pulling. up roofing."
    assert item.gold == 1


def test_winogrande_partial_scoring():
    doc = {"sentence": "Sarah was a better surgeon than Maria so _ got the easier cases.",
           "option1": "Sarah", "option2": "Maria", "answer": "2"}
    item = build_item(get_task("winogrande"), doc)
    assert item.requests == [
        ("Sarah was a better surgeon than Maria so Sarah", " got the easier cases."),
        ("Sarah was a better surgeon than Maria so Maria", " got the easier cases."),
    ]
    assert item.gold == 1


def test_lambada_piqa_arc_openbookqa():
    lam = build_item(get_task("lambada_openai"), {"text": "he said hello to Bob"})
    assert lam.requests == [("he said hello to", " Bob")]
    piqa = build_item(get_task("piqa"), {"goal": "Open a jar", "sol1": "twist", "sol2": "push ", "label": 1})
    assert piqa.requests == [("Question: Open a jar\nAnswer:", " twist"), ("Question: Open a jar\nAnswer:", " push ")]
    arc = build_item(get_task("arc_easy"), {"question": "Q?", "choices": {"text": ["a", "b", "c"], "label": ["1", "2", "3"]},
                                            "answerKey": "3"})
    assert arc.gold == 2 and arc.requests[0] == ("Question: Q?\nAnswer:", " a")
    obqa = build_item(get_task("openbookqa"), {"question_stem": "Stem", "choices": {"text": ["x", "y"], "label": ["A", "B"]},
                                               "answerKey": " B"})
    assert obqa.gold == 1 and obqa.requests[1] == ("Stem", " y")


@pytest.mark.parametrize("name", ALL_TASKS)
def test_bundled_samples_load(name):
    documents = load_documents(get_task(name), "bundled")
    assert len(documents) == 200
    assert all(doc.item.requests for doc in documents)
    assert all(0 <= doc.item.gold for doc in documents)
