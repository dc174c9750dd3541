"""The token check's chain on prompts mixing token ids and embeddings, in a real in-process vLLM engine.

vLLM 0.32 hashes a block with 0 at each embedding position, while the scheduler output's
``prompt_token_ids`` keep the caller's placeholder ids there: two prompts with the same embeddings and
other placeholder ids share blocks, correctly. The writer's views give no chain from a prompt's first
embedding on (``is_token_ids``), so such hits pass. A first version of ``PromptChains`` seeded a hit's chain
from its event ids (placeholders taken for tokens) and refused the third request's correct hit (review,
stop 56).
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_tier import skip_without_vllm  # noqa: E402

skip_without_vllm()

from vllm_harness import Harness, close_llm, make_llm, rand_tokens  # noqa: E402
from vllm_tier import unique_cache_name  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    llm = make_llm(tiny_model_dir, multiprocess=False, cache=unique_cache_name("embchain"), max_model_len=1024,
                   enable_prompt_embeds=True, max_num_batched_tokens=128, enable_chunked_prefill=True)
    try:
        yield {"harness": Harness(llm)}
    finally:
        close_llm(llm)


def test_hits_on_prompts_with_the_same_embeddings_and_other_placeholder_ids_are_served(h):
    from vllm import SamplingParams

    rng = random.Random(7)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ids, extra = rand_tokens(rng, 300), rand_tokens(rng, 40)
    torch.manual_seed(0)
    emb = torch.randn(360, 128)

    def prompt(placeholder: int, tail: list[int]) -> dict:
        t = [placeholder if 100 <= i < 110 else x for i, x in enumerate(ids + tail)]
        return {"prompt_embeds": emb[:len(t)].clone(), "prompt_token_ids": t,
                "prompt_is_token_ids": [not 100 <= i < 110 for i in range(len(t))]}

    outs = []
    for p in (prompt(5, []), prompt(5, extra), prompt(6, extra[:32] + rand_tokens(rng, 8))):
        outs += h.llm.generate([p], sp, use_tqdm=False)  # the first computes, the others hit 288 and 320
    manager = h.rpc("omnishm_stats")["manager"]
    assert [o.num_cached_tokens for o in outs] == [0, 288, 320], [o.num_cached_tokens for o in outs]
    assert manager["token_mismatches"] == 0 and manager["token_checked_rows"] > 0, manager
