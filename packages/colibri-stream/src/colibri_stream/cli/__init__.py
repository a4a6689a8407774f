"""The `colibri-stream` command line: the group, and where each command lives.

    run.py          generate, chat           (serving), and the engine options every command shares
    plan.py         plan                     (the budget plan of a container or an HF config.json)
    serve.py        serve                    (the OpenAI-compatible HTTP server)
    bench.py        bench                    (a budget sweep with disk-honesty checks)
    bench_suite.py  bench-suite              (every workload and cache study)
    traces.py       trace-hf, trace-import,  (routing traces of any MoE, other runtimes' dumps imported,
                    policy-study             policies replayed on them)

Errors are one line on stderr, no traceback. Exit status (exit_status.py, the same for every
Colibri command): 0 ok; 1 a check failed (a blob or tensor failed its checksum or could not be
read back; `bench` found page-cache contamination); 2 bad usage or bad input (a malformed size,
a budget below the minimum, which the message names, a malformed container).
"""

from __future__ import annotations

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="colibri-stream")
def main() -> None:
    """Run a Colibri int4 container bigger than RAM: resident backbone, routed experts streamed
    from disk through a RAM-budgeted cache.

    Exit status: 0 ok, 1 a check failed (e.g. a blob failed its checksum, bench found page-cache
    contamination), 2 bad usage or bad input.
    """


from .bench import bench  # noqa: E402 - commands register on the group defined above
from .bench_suite import bench_suite  # noqa: E402
from .plan import plan  # noqa: E402
from .run import chat, generate  # noqa: E402
from .serve import serve  # noqa: E402
from .traces import policy_study_command, trace_hf, trace_import  # noqa: E402

for _command in (generate, chat, plan, serve, bench, bench_suite, policy_study_command, trace_hf, trace_import):
    main.add_command(_command)

if __name__ == "__main__":
    main()
