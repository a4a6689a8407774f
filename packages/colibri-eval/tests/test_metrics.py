"""Aggregation and standard errors match lm-eval's definitions."""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
from colibri_eval.metrics import aggregate, mean_stderr, multiple_choice_metrics, perplexity_bootstrap_stderr


def _reference_bootstrap(lls, iters):
    """lm-eval's bootstrap_stderr(perplexity) in plain Python, without its process pool."""
    chunk = min(1000, iters)
    stats = []
    for seed in range(iters // chunk):
        rnd = random.Random()
        rnd.seed(seed)
        for _ in range(chunk):
            sample = rnd.choices(lls, k=len(lls))
            stats.append(math.exp(-(sum(sample) / len(sample))))
    mu = sum(stats) / len(stats)
    return math.sqrt(sum((x - mu) ** 2 for x in stats) / (len(stats) - 1))


def test_perplexity_bootstrap_reproduces_lm_eval_sampling():
    lls = [-(i % 11) * 0.7 - 1.3 for i in range(57)]
    assert perplexity_bootstrap_stderr(lls, 2000) == pytest.approx(_reference_bootstrap(lls, 2000), rel=1e-10)
    assert perplexity_bootstrap_stderr(lls, 300) == pytest.approx(_reference_bootstrap(lls, 300), rel=1e-10)


def test_perplexity_bootstrap_equals_lm_eval_function():
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-eval not installed")
    import subprocess
    import sys

    lls = [-(i % 5) * 1.1 - 0.2 for i in range(23)]
    # lm-eval's bootstrap_stderr forks a multiprocessing.Pool; forking this test process (torch
    # threads, other tests' servers) can hang, so lm-eval runs in a fresh process of its own.
    code = (
        "from colibri_eval.lm_eval_compat import import_lm_eval; import_lm_eval()\n"
        "from lm_eval.api.metrics import bootstrap_stderr, perplexity\n"
        f"print(repr(bootstrap_stderr(perplexity, {lls!r}, 1000)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = float(done.stdout.strip().splitlines()[-1])
    assert perplexity_bootstrap_stderr(lls, 1000) == pytest.approx(theirs, rel=1e-10)


def test_mean_metrics_and_ties():
    assert aggregate("acc", [1.0, 0.0, 1.0, 1.0], 10) == (0.75, pytest.approx(mean_stderr([1.0, 0.0, 1.0, 1.0])))
    assert aggregate("acc", [1.0], 10) == (1.0, None)
    value, stderr = aggregate("perplexity", [-1.0, -3.0], 0)
    assert value == pytest.approx(math.exp(2.0)) and stderr is None
    # argmax takes the first of equal scores; acc_norm divides by characters of the choice
    metrics, pred, pred_norm = multiple_choice_metrics([-4.0, -4.0, -6.0], ["ab", "abcd", "abcdefgh"], 2, ("acc", "acc_norm"))
    assert (pred, pred_norm) == (0, 2) and metrics == {"acc": 0.0, "acc_norm": 1.0}
