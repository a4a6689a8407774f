"""Parity with lm-evaluation-harness itself, on the bundled samples and a tiny random Llama.

1. Request construction: lm-eval's own task objects (its YAMLs + hooks, reading our JSONL)
   build exactly our (context, continuation) strings for all 200 items of all seven tasks.
2. Scoring: lm-eval's evaluator with its hf backend and colibri-eval score the same model and
   agree per item (log-likelihoods, greedy flags, per-item metrics) and on every metric and
   stderr; and lm-eval's evaluator driving our ``colibri`` model type agrees too.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs lm-eval and transformers", allow_module_level=True)

from colibri_eval import ALL_TASKS, bundled_data_dir, get_task, load_documents, parse_task_list  # noqa: E402
from colibri_eval.lm_eval_compat import import_lm_eval, write_local_task_yamls  # noqa: E402
from colibri_eval.parity import compare, run_lm_eval  # noqa: E402

LIMIT = 12  # items per task for the model runs (the request check covers all 200)


def test_request_strings_match_lm_eval_on_all_bundled_items(tmp_path):
    import_lm_eval()
    from lm_eval.tasks import TaskManager, get_task_dict

    names = write_local_task_yamls(bundled_data_dir(), tmp_path)
    task_dict = get_task_dict(list(names.values()), TaskManager(include_path=str(tmp_path), include_defaults=False))
    for name in ALL_TASKS:
        task = task_dict[names[name]]
        task.build_all_requests(limit=None, rank=0, world_size=1)
        by_doc: dict[int, list] = {}
        for instance in task.instances:
            by_doc.setdefault(instance.doc_id, []).append((instance.idx, tuple(instance.arguments)))
        ours = load_documents(get_task(name), "bundled")
        assert len(by_doc) == len(ours) == 200
        for doc in ours:
            theirs = [args for _, args in sorted(by_doc[doc.index])]
            assert theirs == [tuple(pair) for pair in doc.item.requests], (name, doc.index)


@pytest.fixture(scope="module")
def ours(tiny_hf_model):
    from colibri_eval.runner import evaluate

    samples: list[dict] = []
    results = evaluate(tiny_hf_model, parse_task_list("all"), "bundled", LIMIT, bootstrap_iters=1000,
                       on_sample=samples.append)
    return results, samples


def test_lm_eval_hf_backend_agrees_per_item_and_metric(tiny_hf_dir, ours):
    results, samples = ours
    theirs, _ = run_lm_eval("hf", f"pretrained={tiny_hf_dir},dtype=float32", list(ALL_TASKS), "bundled", LIMIT,
                            bootstrap_iters=1000, batch_size=16)
    report = compare(theirs, results, samples)
    assert report["agree"], {t: r["problems"] for t, r in report["tasks"].items() if r["problems"]}
    assert set(report["tasks"]) == set(ALL_TASKS)
    assert report["tasks"]["lambada_openai"]["metrics"]["perplexity_stderr"]["lm_eval"] > 0


def test_lm_eval_drives_the_colibri_model_type(tiny_hf_dir, ours):
    import colibri_eval.lm_eval_model  # noqa: F401 - registers "colibri"

    results, samples = ours
    tasks = ["hellaswag", "winogrande", "lambada_openai"]
    theirs, _ = run_lm_eval("colibri", f"pretrained={tiny_hf_dir},backend=hf", tasks, "bundled", LIMIT,
                            bootstrap_iters=1000)
    report = compare(theirs, results, samples)
    assert report["agree"], {t: r["problems"] for t, r in report["tasks"].items() if r["problems"]}


def test_colibri_lm_rolling_and_generation_match_hf_backend(tiny_hf_dir):
    from colibri_eval.lm_eval_model import ColibriLM
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    ours = ColibriLM(pretrained=str(tiny_hf_dir), backend="hf", batch_size=4, device="cpu")
    reference = HFLM(pretrained=str(tiny_hf_dir), dtype="float32", device="cpu", batch_size=4)
    text = "The quick brown fox jumps over the lazy dog, twice. " * 30  # > max_length: several windows
    assert len(ours.tokenizer.encode(text)) > ours.max_length

    def rolling(lm):
        return lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)

    assert rolling(ours)[0] == pytest.approx(rolling(reference)[0], rel=1e-5)

    def generate(lm):
        request = Instance("generate_until", {}, ("Once upon a time", {"until": ["\n\n"], "max_gen_toks": 6}), 0)
        return lm.generate_until([request], disable_tqdm=True)

    assert generate(ours) == generate(reference)


def test_python_m_wrapper_runs_lm_eval_cli_with_colibri_type(tiny_hf_dir, tmp_path):
    """`python -m colibri_eval.lm_eval --model colibri ...` is lm-eval's own CLI end to end."""
    import os
    import subprocess
    import sys

    write_local_task_yamls(bundled_data_dir(), tmp_path / "yaml", ["piqa"])
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "colibri_eval.lm_eval", "--model", "colibri",
         "--model_args", f"pretrained={tiny_hf_dir},backend=hf", "--tasks", "colibri_local_piqa",
         "--include_path", str(tmp_path / "yaml"), "--limit", "3", "--device", "cpu",
         "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "colibri_local_piqa" in proc.stdout and "acc_norm" in proc.stdout
    assert list((tmp_path / "out").rglob("results_*.json"))
