"""Commits and API calls per round of a parallel run, against the Hub's limits (ROUNDS.md, "Limits").

The Hub caps commits at 128 per hour per REPO and API calls per USER (token) over 5-minute windows
(1000 for a free account; resolves, i.e. downloads, have their own 5000). A round costs:

    main repo       1 merge per round + 1 heartbeat per heartbeat_s (+ a claim now and then)
    companion repo  1 contribution per worker + 1 close, per round
    API (merger)    2 reads per poll + 3 per heartbeat + about 3 per contribution + 15 per round
    API (worker)    4 reads per poll (head, RELAY.json, and a claim try) + about 10 per round

Every commit is counted twice (409 / 412 / unknown outcomes resend it), as the lease's own sizing
does, and API calls too; a plan must fit in the limits with that margin. The shortest round counts:
the merger merges early once every slot has contributed, but never sooner than `min_round_s`.

    >>> _ = plan_rounds(workers=8, min_round_s=1800, heartbeat_s=300, poll_s=10).check()   # fits
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import RoundPlanError

HUB_COMMITS_PER_HOUR = 128  # per repo (the 429 text in braindecode/braindecode#947)
HUB_API_PER_5MIN = 1000  # per free user, https://huggingface.co/docs/hub/rate-limits
RETRY_FACTOR = 2.0


@dataclass(frozen=True)
class RoundPlan:
    """What one configuration costs. Rates are nominal (before the retry factor)."""

    workers: int
    min_round_s: float
    heartbeat_s: float
    poll_s: float
    main_commits_per_hour: float
    companion_commits_per_hour: float
    merger_api_per_5min: float
    worker_api_per_5min: float
    commits_limit_per_hour: int = HUB_COMMITS_PER_HOUR
    api_limit_per_5min: int = HUB_API_PER_5MIN

    def problems(self) -> list[str]:
        out = []
        for repo, rate, fix in (
            ("main", self.main_commits_per_hour, f"a heartbeat above {self.heartbeat_s:g}s or longer rounds"),
            ("companion", self.companion_commits_per_hour,
             f"rounds of at least {self._round_for_companion():.0f}s, or fewer workers"),
        ):
            if rate * RETRY_FACTOR > self.commits_limit_per_hour:
                out.append(f"{self.workers} workers with rounds of {self.min_round_s:g}s need {rate:.0f} commits/hour "
                           f"on the {repo} repo ({rate * RETRY_FACTOR:.0f} with retries), over the Hub's "
                           f"{self.commits_limit_per_hour} per hour per repo: use {fix}")
        worst = max(self.merger_api_per_5min, self.worker_api_per_5min)
        if worst * RETRY_FACTOR > self.api_limit_per_5min:
            out.append(f"polling every {self.poll_s:g}s with rounds of {self.min_round_s:g}s needs {worst:.0f} API "
                       f"calls per 5 minutes ({worst * RETRY_FACTOR:.0f} with retries), over the Hub's "
                       f"{self.api_limit_per_5min}: poll less often")
        return out

    def _round_for_companion(self) -> float:
        return (self.workers + 1) * 3600 * RETRY_FACTOR / self.commits_limit_per_hour

    def check(self) -> RoundPlan:
        """Raise RoundPlanError (one line: the first limit exceeded and what to change) or return self."""
        problems = self.problems()
        if problems:
            raise RoundPlanError(problems[0])
        return self

    def as_json(self) -> dict:
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def plan_rounds(*, workers: int, min_round_s: float, heartbeat_s: float, poll_s: float,
                commits_limit_per_hour: int = HUB_COMMITS_PER_HOUR,
                api_limit_per_5min: int = HUB_API_PER_5MIN) -> RoundPlan:
    """The cost of `workers` slots, rounds no shorter than `min_round_s`, the merger's heartbeat and
    everyone's poll period (seconds). `.check()` refuses a plan over the limits."""
    if workers < 1 or min_round_s <= 0 or heartbeat_s <= 0 or poll_s <= 0:
        raise RoundPlanError(f"a round plan needs workers >= 1 and positive times (got workers={workers}, "
                             f"min_round_s={min_round_s}, heartbeat_s={heartbeat_s}, poll_s={poll_s})")
    rounds_per_hour = 3600.0 / min_round_s
    main = rounds_per_hour + 3600.0 / heartbeat_s + 2.0
    companion = rounds_per_hour * (workers + 1)
    per5 = 300.0 / min_round_s
    merger = 300.0 / poll_s * 2 + 300.0 / heartbeat_s * 3 + per5 * (3 * workers + 15)
    worker = 300.0 / poll_s * 4 + per5 * 10
    return RoundPlan(workers, min_round_s, heartbeat_s, poll_s, main, companion, merger, worker,
                     commits_limit_per_hour, api_limit_per_5min)


__all__ = ["RoundPlan", "plan_rounds", "HUB_COMMITS_PER_HOUR", "HUB_API_PER_5MIN"]
