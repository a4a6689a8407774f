"""The ``colibri`` model type for lm-evaluation-harness (its ``LM`` interface).

lm-eval 0.4 has no plugin hook (no entry points; models register only when lm-eval's own
``lm_eval/models/__init__.py`` imports them), so importing this module registers the type and
``python -m colibri_eval.lm_eval`` (console script ``colibri-lm-eval``) runs lm-eval's own CLI
with it loaded:

    python -m colibri_eval.lm_eval --model colibri --model_args pretrained=CKPT_DIR \\
        --tasks piqa --device cpu

model_args: ``pretrained`` (path), ``backend`` (colibri | hf | int4, default colibri),
``dtype`` (float32 | bfloat16), ``batch_tokens`` (padded tokens per forward),
``ram_budget`` (int4 only), ``max_gen_toks`` (default 256). ``batch_size``/``device`` from
lm-eval's CLI are accepted and ignored: batching is by tokens, and the models run on CPU.

- ``loglikelihood``: same encoding and scoring engine as ``colibri-eval run`` (requests of
  one document form one group, so shared contexts are computed once);
- ``loglikelihood_rolling``: lm-eval's rolling windows (``max_length``, context_len 1,
  prefix token) scored as ordinary requests and summed;
- ``generate_until``: greedy decoding (a full forward per token: simple and slow, meant for
  short answers), stopping at end-of-text or the first ``until`` string.
"""

from __future__ import annotations

from itertools import groupby
from typing import Any

import torch
from tqdm.auto import tqdm

from colibri_eval.adapters import load_model
from colibri_eval.lm_eval_compat import import_lm_eval
from colibri_eval.request_encoding import TokenRequest, encode_requests
from colibri_eval.scoring_engine import ScoringEngine

import_lm_eval()

from lm_eval.api.model import LM  # noqa: E402 - after the compatibility shim
from lm_eval.api.registry import MODEL_REGISTRY, register_model  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

__all__ = ["ColibriLM"]


class ColibriLM(LM):
    def __init__(self, pretrained: str, backend: str = "colibri", dtype: str = "float32",
                 batch_tokens: int | str = 1024, ram_budget: str | None = None,
                 max_gen_toks: int | str = 256, **ignored: Any) -> None:
        super().__init__()
        self.loaded = load_model(f"{backend}:{pretrained}", dtype=dtype, ram_budget=ram_budget)
        self.tokenizer = self.loaded.tokenizer
        self.model = self.loaded.model
        self.engine = ScoringEngine(self.model, batch_tokens=int(batch_tokens))
        self.max_gen_toks = int(max_gen_toks)

    @property
    def max_length(self) -> int:
        return self.model.max_length

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        def doc_key(item: tuple[int, Any]) -> Any:
            # one group per document: lm-eval lists a document's requests consecutively
            request = item[1]
            doc_id = getattr(request, "doc_id", None)
            return ("ctx", request.args[0]) if doc_id is None else (getattr(request, "task_name", None), doc_id)

        groups = []
        for _, members in groupby(enumerate(requests), key=doc_key):
            pairs = [tuple(request.args[:2]) for _, request in members]
            groups.append(encode_requests(self.tokenizer, pairs))
        scored = self.engine.score(groups, progress=not disable_tqdm, desc="colibri loglikelihood")
        return [result for group in scored for result in group]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in tqdm(requests, disable=disable_tqdm, desc="colibri rolling"):
            (text,) = request.args[:1]
            windows = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(
                    token_list=self.tokenizer.encode(text), prefix_token=self.tokenizer.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)
            ]
            token_requests = [TokenRequest(tuple(context), tuple(continuation)) for context, continuation in windows]
            scored = self.engine.score([[r] for r in token_requests])
            out.append(sum(group[0][0] for group in scored))
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in tqdm(requests, disable=disable_tqdm, desc="colibri generate"):
            context, gen_kwargs = request.args[:2]
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.get("until") or []
            if isinstance(until, str):
                until = [until]
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            out.append(self.greedy_generate(context, list(until), max_new))
        return out

    def greedy_generate(self, context: str, until: list[str], max_new_tokens: int) -> str:
        budget = max(self.max_length - max_new_tokens, 1)
        ids = self.tokenizer.encode(context)[-budget:] or [self.tokenizer.prefix_token_id]
        generated: list[int] = []
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                window = (ids + generated)[-self.max_length:]
                logits = self.model.logits_at(torch.tensor([window]), torch.tensor([0]), torch.tensor([len(window) - 1]))
                token = int(logits[0].argmax())
                if token == self.tokenizer.eot_token_id:
                    break
                generated.append(token)
                text = self.tokenizer.decode(generated)
                if any(stop in text for stop in until):
                    break
        text = self.tokenizer.decode(generated)
        for stop in until:
            if stop and stop in text:
                text = text.split(stop)[0]
        return text


if "colibri" not in MODEL_REGISTRY:
    register_model("colibri")(ColibriLM)
