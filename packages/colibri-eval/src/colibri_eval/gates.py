"""Quality gates for CI: absolute bars (``--min``) and a baseline comparison (``--max-drop``).

``--min TASK.METRIC=V`` passes when the score is >= V; ``--min TASK.METRIC<=V`` when it is
<= V (for perplexity). ``--baseline OLD.json --max-drop D`` compares every metric present in
both runs. A *drop* is measured in the metric's bad direction: old - new for accuracies
(absolute, so 0.02 = two points), (new - old) / old for perplexity (relative). A drop fails
the gate only when it exceeds D AND lies outside the noise, i.e. more than 2 combined
standard errors (sqrt(se_old^2 + se_new^2)); a drop above D but inside 2 se is reported as
``noise``: on a 200-item sample one item is half a point, so a strict rule would be flaky.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from colibri_eval.errors import GateSpecError
from colibri_eval.results import LOWER_IS_BETTER, EvalResults

_MIN_PATTERN = re.compile(r"^\s*([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)\s*(<=|>=|=)\s*([-+0-9.eE]+)\s*$")
NOISE_SIGMAS = 2.0


@dataclass(frozen=True)
class Bar:
    task: str
    metric: str
    op: str  # ">=" or "<="
    value: float

    def describe(self) -> str:
        return f"{self.task}.{self.metric} {self.op} {self.value:g}"


def parse_bar(text: str) -> Bar:
    match = _MIN_PATTERN.match(text)
    if not match:
        raise GateSpecError(f"bad --min {text!r}: expected TASK.METRIC=VALUE or TASK.METRIC<=VALUE")
    task, metric, op, raw = match.groups()
    try:
        value = float(raw)
    except ValueError:
        raise GateSpecError(f"bad --min {text!r}: {raw!r} is not a number") from None
    return Bar(task, metric, "<=" if op == "<=" else ">=", value)


def check_bars(results: EvalResults, bars: list[Bar]) -> list[str]:
    """One line per bar, starting with PASS or FAIL."""
    lines = []
    for bar in bars:
        got = results.metric(bar.task, bar.metric)
        if got is None:
            lines.append(f"FAIL {bar.describe()}: not measured in this run")
            continue
        ok = got.value >= bar.value if bar.op == ">=" else got.value <= bar.value
        lines.append(f"{'PASS' if ok else 'FAIL'} {bar.describe()}: got {got.value:.4f}")
    return lines


@dataclass(frozen=True)
class Comparison:
    task: str
    metric: str
    old: float
    new: float
    drop: float  # in the metric's bad direction (see module docstring)
    noise: float | None  # NOISE_SIGMAS * combined stderr, in the same units as drop
    verdict: str  # "ok" | "noise" | "REGRESSION"

    def line(self) -> str:
        noise = "n/a" if self.noise is None else f"{self.noise:.4f}"
        return (f"{self.verdict:<10} {self.task}.{self.metric}: {self.old:.4f} -> {self.new:.4f} "
                f"(drop {self.drop:+.4f}, 2se {noise})")


def compare_with_baseline(new: EvalResults, old: EvalResults, max_drop: float) -> list[Comparison]:
    out = []
    for task, new_task in new.tasks.items():
        old_task = old.tasks.get(task)
        if old_task is None:
            continue
        for metric, new_value in new_task.metrics.items():
            old_value = old_task.metrics.get(metric)
            if old_value is None:
                continue
            if metric in LOWER_IS_BETTER:
                scale = abs(old_value.value) or 1.0
                drop = (new_value.value - old_value.value) / scale
            else:
                scale = 1.0
                drop = old_value.value - new_value.value
            noise = None
            if new_value.stderr is not None and old_value.stderr is not None:
                noise = NOISE_SIGMAS * math.sqrt(new_value.stderr ** 2 + old_value.stderr ** 2) / scale
            if drop <= max_drop:
                verdict = "ok"
            elif noise is not None and drop <= noise:
                verdict = "noise"
            else:
                verdict = "REGRESSION"
            out.append(Comparison(task, metric, old_value.value, new_value.value, drop, noise, verdict))
    return out
