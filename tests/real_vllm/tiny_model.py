"""Generate the real-vLLM tier's tiny Llama and its tokenizer into a directory, seeded: identical bytes every run.

Run with the tier's venv (it needs torch, transformers and tokenizers)::

    python tests/real_vllm/tiny_model.py OUT_DIR

No hub: the tokenizer is a byte-level BPE of 512 tokens trained on text generated here, the model a 2-layer Llama
with random (seeded) weights.  Its output is nonsense, but deterministic under greedy sampling, which is what the
tests compare.  The CPU attention backend needs a head size of at least 32 (hidden 128 / 4 heads).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

SEED = 20
VOCAB = 512
SPECIALS = ["<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WORDS = ("the a narwhal router engine prefill decode cache token stream request model fleet handoff moves "
         "every quickly slowly under over and or with from to is was will be one two three four five six "
         "seven eight nine ten hello world sea ice whale tusk north cold light dark time").split()


def corpus(n_lines: int = 4000) -> list[str]:
    """Seeded sentences over a small vocabulary, with digits and punctuation, for the BPE trainer."""
    rng = random.Random(SEED)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
    return lines


def build(out: Path) -> None:
    """Train the tokenizer, build the model, save both into ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    random.seed(SEED)
    torch.manual_seed(SEED)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="</s>", model_max_length=2048)
    tokenizer.chat_template = CHAT_TEMPLATE

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=bos, eos_token_id=tok.token_to_id("</s>"), pad_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Larger-than-default weights make the logits less flat, so greedy picks are clear-cut, not float ties.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py OUT_DIR")
    build(Path(sys.argv[1]))
