"""lm-eval's `local-completions` model scores a task through `colibri-stream serve` (the real
server, its `/tokenize` endpoints and `/v1/completions` with `echo`), and every item's
log-likelihoods equal colibri-eval's direct scoring of the same container."""

from __future__ import annotations

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from colibri_eval import evaluate, load_model, parse_task_list  # noqa: E402
from colibri_int4 import QuantScheme, export_checkpoint  # noqa: E402
from colibri_model import ColibriConfig, ColibriForCausalLM  # noqa: E402
from colibri_stream import Engine  # noqa: E402
from colibri_stream.serve import make_server, serve_in_thread  # noqa: E402

TINY = dict(name="serve-eval", d_model=64, n_layers=3, n_dense_layers=1, n_heads=2, n_kv_heads=1, head_dim=32,
            dense_ffn_dim=128, n_experts=8, expert_dim=64, shared_expert_dim=64, max_seq_len=256, top_k_train=2,
            top_k_infer=1, init_std=0.05)
MODEL = "tiny-eval"


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve_eval")
    torch.manual_seed(0)
    ColibriForCausalLM(ColibriConfig(**TINY)).save_pretrained(directory / "ckpt")
    export_checkpoint(directory / "ckpt", directory / "tiny.coli", QuantScheme(group_size=32))
    return directory / "tiny.coli"


def test_local_completions_through_the_server_equals_direct_scoring(container):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    loaded = load_model(f"int4:{container}", ram_budget="200MB")
    samples: list[dict] = []
    evaluate(loaded, parse_task_list("piqa,lambada_openai"), "bundled", limit=4, on_sample=samples.append)
    pairs = [tuple(pair) for s in samples for pair in s["arguments"]]
    direct = [ll for s in samples for ll in s["loglikelihoods"]]
    greedy = [g for s in samples for g in s["is_greedy"]]

    with Engine.open(container, ram_budget="200MB", dtype="float32") as engine:  # colibri-eval's engine options
        server = make_server(engine, "127.0.0.1", 0, model_name=MODEL)
        serve_in_thread(server)
        try:
            lm = LocalCompletionsAPI(base_url=f"{server.url}/completions", model=MODEL, tokenizer_backend="auto",
                                     tokenized_requests=True, max_length=engine.max_context, max_retries=1)
            assert lm.tokenizer_backend == "remote"  # found the server's /tokenizer_info and /tokenize
            requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
            served = lm.loglikelihood(requests, disable_tqdm=True)
        finally:
            server.shutdown()
            server.server_close()
    assert len(served) == len(direct) == len(pairs) > 8
    # colibri-eval packs several requests in a row, the server runs one session per request: the int4
    # kernels round a many-row product unlike a one-row one (3.7e-4 at most seen here), far below what
    # moves a metric; the greedy flags agree exactly
    assert [ll for ll, _ in served] == pytest.approx(direct, abs=1e-3)
    assert [g for _, g in served] == greedy
