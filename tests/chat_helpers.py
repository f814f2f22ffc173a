"""A tiny ChatML model that ends its turn: shared by the chat server, CLI and playground tests."""

from __future__ import annotations

import torch

from scratchlm.generate.decoding import generate
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer

CONTEXT = 128
TOKENIZER = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).with_chatml()  # specials 256-258
IM_END = TOKENIZER.special_id("<|im_end|>")
SYSTEM = "You tell stories."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A story?"}]
PROMPT = TOKENIZER.encode_chat(MESSAGES, add_generation_prompt=True)
TURN = 4  # chat_model() ends its reply to MESSAGES after this many tokens


def chat_model(seed: int = 0) -> TransformerLM:
    """A tiny ChatML model whose greedy reply to MESSAGES is TURN tokens, then <|im_end|>: the output row of
    <|im_end|> scores -1000 at the positions that predict the reply's tokens and +1000 at the one after them (the
    least-squares row through those final hidden states)."""
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=TOKENIZER.vocab_size, context_length=CONTEXT)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharper logits than the init's
        model.lm_head.weight[IM_END] = 0
        reply = generate(model, PROMPT, TURN, temperature=0)[0]
        seen = []
        handle = model.lm_head.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
        model(torch.tensor([PROMPT + reply]))
        handle.remove()
        hidden = seen[0][0, len(PROMPT) - 1:]  # (TURN + 1, d): the states that predict the reply, then its end
        target = torch.full((TURN + 1, 1), -1000.0)
        target[-1] = 1000.0
        model.lm_head.weight[IM_END] = torch.linalg.lstsq(hidden, target).solution[:, 0]
    assert generate(model, PROMPT, TURN + 1, temperature=0)[0] == reply + [IM_END]
    return model
