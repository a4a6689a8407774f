"""Model specs and the colibri / int4 adapters (skipped when their packages are absent)."""

from __future__ import annotations

import importlib.util

import pytest
from colibri_eval import ModelSpecError, get_task, load_documents
from colibri_eval.adapters import parse_model_spec


def test_model_spec_parsing():
    assert parse_model_spec("hf:/a/b") == ("hf", "/a/b")
    assert parse_model_spec("int4:x.c4") == ("int4", "x.c4")
    for bad in ("/a/b", "gguf:/x", "hf:"):
        with pytest.raises(ModelSpecError, match="expected hf:PATH, colibri:PATH or int4:PATH"):
            parse_model_spec(bad)


def test_missing_hf_dir_is_one_line(tmp_path):
    pytest.importorskip("transformers")
    from colibri_eval import load_model

    with pytest.raises(ModelSpecError) as info:
        load_model(f"hf:{tmp_path / 'nope'}")
    assert "\n" not in str(info.value)


def _has(module: str, attr: str) -> bool:
    if importlib.util.find_spec(module) is None:
        return False
    try:
        return hasattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 - a half-written package counts as absent
        return False


@pytest.mark.skipif(not _has("colibri_model", "ColibriForCausalLM"), reason="colibri-model not installed")
def test_colibri_checkpoint_adapter(tmp_path):
    import torch
    from colibri_eval import load_model
    from colibri_eval.request_encoding import encode_requests
    from colibri_eval.scoring_engine import ScoringEngine
    from colibri_model import ColibriForCausalLM, get_preset

    torch.manual_seed(0)
    model = ColibriForCausalLM(get_preset("tiny"))
    model.save_pretrained(tmp_path)
    loaded = load_model(f"colibri:{tmp_path}")
    docs = load_documents(get_task("piqa"), "bundled", limit=1) + load_documents(get_task("hellaswag"),
                                                                                 "bundled", limit=2)
    groups = [encode_requests(loaded.tokenizer, doc.item.requests) for doc in docs]
    assert loaded.model.supports_packing  # packed rows: documents side by side under a tree mask
    scored = ScoringEngine(loaded.model, row_tokens=96).score(groups)
    for request, (ll, _) in zip([r for g in groups for r in g], [s for g in scored for s in g], strict=True):
        full = torch.tensor([list(request.context) + list(request.continuation)[:-1]])
        with torch.no_grad():
            logp = torch.log_softmax(model.eval()(full).logits[0].float(), -1)[-len(request.continuation):]
        want = float(logp.gather(1, torch.tensor(request.continuation)[:, None]).sum())
        assert ll == pytest.approx(want, rel=1e-4, abs=1e-3)


@pytest.mark.skipif(not (_has("colibri_model", "ColibriForCausalLM") and importlib.util.find_spec("lm_eval")),
                    reason="colibri-model or lm-eval not installed")
def test_lm_eval_colibri_type_defaults_to_checkpoints(tmp_path):
    import torch
    from colibri_eval.lm_eval_model import ColibriLM
    from colibri_eval.request_encoding import encode_requests
    from colibri_eval.scoring_engine import ScoringEngine
    from colibri_model import ColibriForCausalLM, get_preset

    torch.manual_seed(1)
    ColibriForCausalLM(get_preset("tiny")).save_pretrained(tmp_path)
    lm = ColibriLM.create_from_arg_string(f"pretrained={tmp_path}", {"batch_size": 8, "device": "cpu"})
    assert lm.loaded.kind == "colibri"
    from lm_eval.api.instance import Instance

    doc = load_documents(get_task("arc_easy"), "bundled", limit=1)[0]
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(doc.item.requests)]
    got = lm.loglikelihood(instances, disable_tqdm=True)
    [want] = ScoringEngine(lm.model).score([encode_requests(lm.tokenizer, doc.item.requests)])
    assert got == want


@pytest.mark.skipif(not (_has("colibri_stream", "Engine") and _has("colibri_int4", "export_checkpoint")),
                    reason="colibri-stream / colibri-int4 not installed")
def test_int4_adapter_scores_like_the_engine(tmp_path):
    import torch
    from colibri_eval import load_model
    from colibri_eval.request_encoding import encode_requests
    from colibri_eval.scoring_engine import ScoringEngine
    from colibri_int4 import export_checkpoint
    from colibri_model import ColibriForCausalLM, get_preset

    torch.manual_seed(0)
    ColibriForCausalLM(get_preset("tiny")).save_pretrained(tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "model.coli")
    loaded = load_model(f"int4:{tmp_path / 'model.coli'}", ram_budget="2GB")
    doc = load_documents(get_task("winogrande"), "bundled", limit=1)[0]
    requests = encode_requests(loaded.tokenizer, doc.item.requests)
    [scores] = ScoringEngine(loaded.model).score([requests])
    engine = loaded.model.engine
    for request, (ll, _) in zip(requests, scores, strict=True):
        logits = engine.logits(list(request.context) + list(request.continuation)[:-1])
        logp = torch.log_softmax(logits.float(), -1)[-len(request.continuation):]
        want = float(logp.gather(1, torch.tensor(request.continuation)[:, None]).sum())
        assert ll == pytest.approx(want, rel=1e-5, abs=1e-3)


@pytest.mark.skipif(not (_has("colibri_stream", "Engine") and _has("colibri_int4", "export_checkpoint")),
                    reason="colibri-stream / colibri-int4 not installed")
def test_colibri_and_int4_models_hold_tensors_in_the_same_dtypes_in_bf16(tmp_path):
    """One rule (colibri_model.held_dtype): 1-D tensors fp32, matrices bf16, on both paths."""
    import torch
    from colibri_eval import load_model
    from colibri_int4 import export_checkpoint
    from colibri_model import ColibriForCausalLM, get_preset, held_dtype

    torch.manual_seed(0)
    ColibriForCausalLM(get_preset("tiny")).save_pretrained(tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "model.coli")
    dense = load_model(f"colibri:{tmp_path / 'ckpt'}", dtype="bfloat16").model.model
    int4 = load_model(f"int4:{tmp_path / 'model.coli'}", dtype="bfloat16", ram_budget="2GB")
    streamed = int4.model.engine.model
    assert int4.info["dtype"] == "bfloat16"

    def dtypes(model):  # the routed experts are stacked in one and streamed in the other
        return {n: t.dtype for n, t in model.state_dict().items() if ".moe.experts." not in n}

    # a native-kernel engine holds the q4/q8 projections as stored bytes, not as torch parameters,
    # and a tied embedding too (its head as stored, its lookups from the file)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed")
    as_stored = set(dtypes(dense)) - set(dtypes(streamed))
    assert all(n.rsplit(".", 2)[-2] in projections for n in as_stored)
    assert {n: d for n, d in dtypes(dense).items() if n not in as_stored} == dtypes(streamed)
    norms = {n: d for n, d in dtypes(dense).items() if n.endswith("norm.weight")}
    assert norms and set(norms.values()) == {torch.float32}
    assert dtypes(dense)["layers.0.attn.q_proj.weight"] == torch.bfloat16
    assert all(d == held_dtype(dense.state_dict()[n].shape, torch.bfloat16) for n, d in dtypes(dense).items())


@pytest.mark.skipif(not (_has("colibri_stream", "Engine") and _has("colibri_int4", "export_checkpoint")),
                    reason="colibri-stream / colibri-int4 not installed")
def test_int4_shared_prefixes_score_like_full_rows(tmp_path):
    """The int4 adapter runs a shared context once on an engine session (append, then each
    continuation appended and truncated away): the same scores as every row in full."""
    import torch
    from colibri_eval import load_model
    from colibri_eval.request_encoding import encode_requests
    from colibri_eval.scoring_engine import ScoringEngine
    from colibri_int4 import export_checkpoint
    from colibri_model import ColibriForCausalLM, get_preset

    torch.manual_seed(0)
    ColibriForCausalLM(get_preset("tiny")).save_pretrained(tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "model.coli")
    loaded = load_model(f"int4:{tmp_path / 'model.coli'}", ram_budget="2GB")
    assert loaded.model.supports_prefix_cache
    docs = load_documents(get_task("arc_easy"), "bundled", limit=2) + load_documents(get_task("hellaswag"),
                                                                                     "bundled", limit=1)
    items = [encode_requests(loaded.tokenizer, d.item.requests) for d in docs]
    engine = loaded.model.engine
    before = engine.stats.prefill_tokens
    runs = {}
    for pack in (False, True):  # the session path (prefix appended, then branches) and packed rows
        for share in (True, False):
            before, steps = engine.stats.prefill_tokens, engine.stats.steps
            runs[pack, share] = ScoringEngine(loaded.model, share_prefixes=share, pack=pack).score(items)
            runs[pack, share, "tokens"] = engine.stats.prefill_tokens - before
            runs[pack, share, "passes"] = engine.stats.steps - steps
        assert runs[pack, True, "tokens"] < runs[pack, False, "tokens"]  # the contexts ran once
    # packed: every document in one pass (the session path runs a pass per context)
    assert runs[True, True, "passes"] < runs[False, True, "passes"]
    assert runs[True, True, "tokens"] <= runs[False, True, "tokens"]
    # The same rows in other batch shapes: with torch's int4 kernel (bf16 activations, which
    # compute="auto" takes where it is timed much faster) each shape has its own tiling, so the
    # sums agree to bf16's rounding, about 1e-5 of a 100-nat loglikelihood (measured 1.3e-3 on
    # an AVX-512 EPYC); the native kernel computes each row alone and agrees bit for bit.
    for key in ((False, True), (True, True), (True, False)):
        for a, b in zip(runs[key], runs[False, False], strict=True):
            for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a, b, strict=True):
                assert ll_a == pytest.approx(ll_b, rel=1e-4, abs=1e-3) and greedy_a == greedy_b
