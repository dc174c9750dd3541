"""A tiny random-weight Llama and a WordLevel tokenizer, built offline at test time.

Sizes follow ../shared/VLLM-CPU.md: vocab 1000, hidden 128, 2 layers, 4 heads,
2 kv heads, head_dim 32 (a head size the CPU attention backend accepts),
intermediate 256, max positions 2048. Weights are random (seeded), so the
hidden states are meaningless but deterministic, which is all the tier needs.
Nothing is downloaded: ``transformers`` and ``tokenizers`` only write files.
"""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 1000
NUM_SPECIAL = 4  # <unk> <s> </s> <pad>


def build_tiny_llama(out_dir: Path | str, *, seed: int = 0) -> Path:
    """Write model + tokenizer into ``out_dir`` and return it. Needs torch, transformers, tokenizers."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                         tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({f"w{i}": i for i in range(NUM_SPECIAL, VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(out)
    return out


if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"))
