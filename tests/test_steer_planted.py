"""Ablating a direction trained on a planted feature removes the feature's effect (measured): a tiny
model whose tokens 'a' and 'z' differ only by a planted direction."""
import torch

import kvwire as kw

from .conftest import FAMILIES
from .tokenizers_for_tests import char_level

WORDS = ["the cat sat on", "a big red", "hello there my", "we went to", "some more text", "it is a", "one two",
         "quiet now and"]


def planted():
    lm = kw.from_hf(FAMILIES["llama"](vocab_size=100))
    lm.tokenizer = char_level()
    z, a = lm.tokenizer.encode("z")[-1], lm.tokenizer.encode("a")[-1]
    p = torch.randn(32, generator=torch.Generator().manual_seed(0))
    p /= p.norm()
    with torch.no_grad():
        embed = lm.backbone.embed_tokens.weight
        embed[a] = embed[z]  # 'a' and 'z' now differ only by the planted direction
        embed[z] += 4 * p
    return lm, p


def effect(lm, model):
    """Mean L1 distance of next-token log-probabilities between prompts ending ' z' and ' a'."""
    def lp(text):
        return model(torch.tensor([lm.tokenizer.encode(text)]))[0, -1].log_softmax(-1)
    with torch.no_grad():
        return float(torch.stack([(lp(w + " z") - lp(w + " a")).abs().sum() for w in WORDS]).mean())


def everywhere(lm, d):
    """`d` projected out of every residual write: the embedding, every attention and MLP write."""
    return lm.ablate(d, layers=[0], site="resid_pre").ablate(d, site="attn_out").ablate(d, site="mlp_out")


def test_ablating_a_trained_direction_removes_the_planted_feature():
    lm, p = planted()
    base = effect(lm, lm)
    assert base > 5  # the planted direction changes the next token's distribution a lot
    vec = kw.ControlVector.train(lm, [w + " z" for w in WORDS], [w + " a" for w in WORDS], layers=[0],
                                 site="resid_pre", method="mean_diff", progress=False)
    d = vec.directions[0]
    assert torch.nn.functional.cosine_similarity(d, p, dim=0) > 0.999  # found: the planted direction
    assert effect(lm, everywhere(lm, d)) < 1e-3 * base  # measured: the effect is gone
    other = torch.randn(32, generator=torch.Generator().manual_seed(1))
    assert effect(lm, everywhere(lm, other)) > 0.5 * base  # a random direction leaves most of it


def test_a_direction_read_after_a_block_removes_part_of_it():
    """Trained at block 0's output, the direction is the planted one as the block has moved it: not
    all of the effect goes (measured 0.45 of it stays), but most of the gap to a random direction."""
    lm, p = planted()
    base = effect(lm, lm)
    vec = kw.ControlVector.train(lm, [w + " z" for w in WORDS], [w + " a" for w in WORDS], layers=[0],
                                 method="mean_diff", progress=False)
    left = effect(lm, everywhere(lm, vec.directions[0])) / base
    other = torch.randn(32, generator=torch.Generator().manual_seed(1))
    assert left < 0.6 and left < 0.7 * effect(lm, everywhere(lm, other)) / base
