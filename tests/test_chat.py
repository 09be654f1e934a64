"""`lm.chat`: the model's own template, the end-of-turn stop, streaming, and the next turn reusing
the previous one's keys/values (same reply as prefilling everything)."""
import pytest
import torch

import kvwire as kw
from kvwire.io.chat_template import ChatTemplate
from kvwire.io.tokenizer import Tokenizer

from .conftest import FAMILIES
from .test_chat_template import CHATML, backend


@pytest.fixture
def chat_lm():
    """A tiny random llama with a byte-level tokenizer and SmolLM2's ChatML template."""
    b = backend()
    lm = kw.from_hf(FAMILIES["llama"](vocab_size=b.get_vocab_size(), max_position_embeddings=512))
    lm.tokenizer = Tokenizer(b, bos_token_id=b.token_to_id("<|im_start|>"), eos_token_ids=[b.token_to_id("<|endoftext|>")],
                             chat_template=ChatTemplate(CHATML, "ChatML"))
    return lm


MESSAGES = [{"role": "user", "content": "Hi there"}]


def rendered_ids(lm, messages):
    return lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def test_chat_is_generate_on_the_rendered_template_and_stops_at_the_end_of_turn(chat_lm, monkeypatch):
    lm = chat_lm
    ids = torch.tensor(rendered_ids(lm, MESSAGES))
    assert lm.tokenizer.decode(ids.tolist(), skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    free = lm.generate(ids, max_new_tokens=12, ignore_eos=True).tolist()
    assert lm.chat(MESSAGES, max_new_tokens=12) == lm.tokenizer.decode(free)
    # the template's end-of-turn tokens end the reply: declare the first token that the free run
    # produces a second distinct time one
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    eot = free[k]
    monkeypatch.setattr(Tokenizer, "end_of_turn_ids", property(lambda self: (eot,)))
    assert lm.chat(MESSAGES, max_new_tokens=12) == lm.tokenizer.decode(free[:k])
    assert "".join(lm.chat(MESSAGES, max_new_tokens=12, stream=True)) == lm.tokenizer.decode(free[:k])


def test_the_next_turn_reuses_the_conversation_and_equals_a_full_prefill(chat_lm):
    lm = chat_lm
    reply = lm.chat(MESSAGES, max_new_tokens=10, sampler=kw.TopK(5), seed=3)
    assert len(lm.prefix_store) == 1
    turn2 = MESSAGES + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More"}]
    again = lm.chat(turn2, max_new_tokens=10, sampler=kw.TopK(5), seed=3)
    assert lm.prefix_store.hits == 1
    assert again == lm.chat(turn2, max_new_tokens=10, sampler=kw.TopK(5), seed=3, reuse_prefix=False)
    streamed = "".join(lm.chat(turn2, max_new_tokens=10, sampler=kw.TopK(5), seed=3, stream=True))
    assert streamed == again


def test_chat_refuses_what_it_cannot_do(chat_lm):
    lm = chat_lm
    with pytest.raises(ValueError, match="beam search runs through generate"):
        lm.chat(MESSAGES, sampler=kw.BeamSearch(2))
    with pytest.raises(ValueError, match="messages must be a non-empty list .* got an empty list"):
        lm.chat([])
    plain = kw.from_hf(FAMILIES["llama"]())
    plain.tokenizer = None
    with pytest.raises(ValueError, match="this model has no tokenizer, so it has no chat template"):
        plain.chat(MESSAGES)
    b = backend()
    lm.tokenizer = Tokenizer(b, eos_token_ids=[b.token_to_id("<|endoftext|>")])
    with pytest.raises(ValueError, match="this model has no chat template"):
        lm.chat(MESSAGES)
