"""A tiny chat model (byte-level tokenizer, ChatML template), two control vectors over its width, and
a uvicorn server on 127.0.0.1 in a background thread, for the server and chat-command tests."""
import socket
import threading
import time

import torch
from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

import kvwire as kw
from kvwire.io.chat_template import ChatTemplate
from kvwire.io.tokenizer import Tokenizer

from .conftest import FAMILIES

SPECIALS = ["<|im_start|>", "<|im_end|>"]
VOCAB = 260  # 256 bytes, the two specials, two spare ids
CHATML = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
          "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def backend():
    """Byte-level BPE without merges (one token per byte), so any text encodes, plus ChatML's specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Backend(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def tiny_chat_hf(context=256, **overrides):
    """A tiny random transformers llama whose ids fit `backend()`, ending turns at <|im_end|>."""
    end = backend().token_to_id("<|im_end|>")
    return FAMILIES["llama"](vocab_size=VOCAB, max_position_embeddings=context, eos_token_id=end, bos_token_id=end,
                             **overrides)


def tiny_chat_lm(context=256, **overrides):
    """`tiny_chat_hf` with its tokenizer and ChatML template; `context` positions (a tool schema in a
    system message takes hundreds of byte tokens); `overrides` go to its config."""
    lm = kw.from_hf(tiny_chat_hf(context, **overrides))
    b = backend()
    lm.tokenizer = Tokenizer(b, eos_token_ids=[b.token_to_id("<|im_end|>")], chat_template=ChatTemplate(CHATML))
    return lm


def control_vectors(lm):
    width = lm.head.weight.shape[1]
    g = torch.Generator().manual_seed(0)
    return {"happy": kw.ControlVector({1: 3 * torch.randn(width, generator=g), 2: 3 * torch.randn(width, generator=g)}),
            "formal": kw.ControlVector({1: 3 * torch.randn(width, generator=g), 3: 3 * torch.randn(width, generator=g)})}


class Server:
    """uvicorn serving `app` on a free 127.0.0.1 port in a daemon thread; `close()` stops it."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
