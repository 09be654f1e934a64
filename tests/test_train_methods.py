"""Training methods on tiny models with a planted direction: each recovers it; states are read at the
site and token positions asked for (== a tap of the uncached forward); bad input is refused."""
import pytest
import torch

import kvwire as kw
from kvwire.graph import site_calls
from kvwire.layers import SITES
from kvwire.steer.train import METHODS, prompt_states

from .conftest import FAMILIES
from .tokenizers_for_tests import char_level

# pair k: the same prompt ending in a positive letter (its embedding moved by +a_k u) or a negative
# one (-a_k u); the a_k vary, so the differences' spread lies along u too (what pca_diff finds)
POS_LETTERS, NEG_LETTERS = "ACEGIKMOQSUWY", "BDFHJLNPRTVXZ"
PREFIXES = ["Pick one: ", "Which is it? ", "Answer ", "Q: yes or no? ", "Say: "]
POSITIVE = [f"{PREFIXES[k % 5]}({p}" for k, p in enumerate(POS_LETTERS)]
NEGATIVE = [f"{PREFIXES[k % 5]}({n}" for k, n in enumerate(NEG_LETTERS)]
SILENCED = ("o_proj", "down_proj", "c_proj")  # what attention and the MLP write to the stream


def _char_id(c):
    return char_level().encode(c, add_bos=False)[0]


def _planted(family, silence=True, seed=1):
    """(lm, u): a tiny model whose letter embeddings carry +-a_k u; with `silence`, no block writes to
    the residual stream, so every block's input and output at a token is its embedding."""
    hf = FAMILIES[family](vocab_size=100)
    width = hf.get_input_embeddings().weight.shape[1]
    u = torch.nn.functional.normalize(torch.randn(width, generator=torch.Generator().manual_seed(seed)), dim=0)
    with torch.no_grad():
        table = hf.get_input_embeddings().weight
        for k, (p, n) in enumerate(zip(POS_LETTERS, NEG_LETTERS)):
            amplitude = 3.0 * (1 + 0.5 * k)
            table[_char_id(p)] += amplitude * u
            table[_char_id(n)] -= amplitude * u
        for name, param in hf.named_parameters():
            if silence and name.rpartition(".")[0].endswith(SILENCED):
                param.zero_()
    lm = kw.from_hf(hf)
    lm.tokenizer = char_level()
    return lm, u


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("method", METHODS)
def test_every_method_recovers_a_planted_direction(family, method):
    lm, u = _planted(family)
    vec = kw.ControlVector.train(lm, POSITIVE, NEGATIVE, layers="1-2", method=method, progress=False)
    assert vec.method == method and vec.layers == [1, 2]
    for i in vec.layers:
        assert _cos(vec.directions[i], u) > 0.9, (i, _cos(vec.directions[i], u))
    # scaled like every method: strength 1 moves a state by the mean separation along the direction
    states = prompt_states(lm, POSITIVE + NEGATIVE, ["layers.1.block_out" if family != "gpt2" else "h.1.block_out"],
                           progress=False)
    (s,) = states.values()
    d = vec.directions[1].double()
    separation = ((s[:len(POSITIVE)] - s[len(POSITIVE):]).double() @ d / d.norm()).mean()
    torch.testing.assert_close(d.norm(), separation, rtol=1e-4, atol=1e-6)


def test_positions_pick_the_token_that_carries_the_concept():
    lm, u = _planted("llama")
    closed = [t + ")" for t in POSITIVE], [t + ")" for t in NEGATIVE]  # the letter is now the 2nd-last token
    vec = kw.ControlVector.train(lm, *closed, layers=[1], method="mean_diff", positions=-2, progress=False)
    assert _cos(vec.directions[1], u) > 0.99
    mean = kw.ControlVector.train(lm, *closed, layers=[1], method="mean_diff", positions="mean", progress=False)
    assert _cos(mean.directions[1], u) > 0.99  # the other tokens cancel between the two sides
    # silenced blocks: the closing ")" knows nothing of the letter before it
    with pytest.raises(ValueError, match="cannot train a mean_diff direction at block 1: positive and negative "
                                         "prompts give the same hidden states"):
        kw.ControlVector.train(lm, *closed, layers=[1], method="mean_diff", positions="last", progress=False)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_states_are_read_at_the_site_and_positions_asked_for(family):
    lm, _ = _planted(family, silence=False)
    texts = ["Hello there", "Hi", "A longer prompt here"]  # left padding in one batch
    blocks = kw.block_calls(lm.backbone)
    for site in SITES:
        call = site_calls(lm.backbone, site, [1])[1]
        tapped = kw.tap(lm.backbone, call, depth="layer")
        runs = [tapped(torch.tensor([lm.tokenizer.encode(t)]))[1][call][0] for t in texts]  # (T, D) each
        for positions, pick in (("last", lambda r: r[-1]), ("mean", lambda r: r.mean(0)), (-2, lambda r: r[-2])):
            got = prompt_states(lm, texts, [call], positions, progress=False)[call]
            torch.testing.assert_close(got, torch.stack([pick(r) for r in runs]), atol=2e-5, rtol=1e-4)
    assert blocks  # the sites differ from one another (a tap of the wrong one would fail above)
    attn = kw.ControlVector.train(lm, POSITIVE, NEGATIVE, layers=[1], method="mean_diff", site="attn_out",
                                  progress=False)
    call = site_calls(lm.backbone, "attn_out", [1])[1]
    tapped = kw.tap(lm.backbone, call, depth="layer")
    last = lambda t: tapped(torch.tensor([lm.tokenizer.encode(t)]))[1][call][0, -1]
    expected = torch.stack([last(p) - last(n) for p, n in zip(POSITIVE, NEGATIVE)]).mean(0)
    torch.testing.assert_close(attn.directions[1], expected, atol=2e-5, rtol=1e-4)
    assert attn.site == "attn_out" and attn.operation == "add"


def test_bad_training_input():
    lm, _ = _planted("llama")
    with pytest.raises(ValueError, match=r"method must be one of \('pca_diff', 'pca_center', 'mean_diff', 'caa', "
                                         r"'logistic'\), got 'lda'"):
        kw.ControlVector.train(lm, POSITIVE, NEGATIVE, method="lda", progress=False)
    with pytest.raises(ValueError, match=r"method 'caa' expects pairs that end in different answer letters after "
                                         r"the same prompt .* pair 0 is 'Pick one: \(A' and 'Pick one: \(a'"):
        kw.ControlVector.train(lm, POSITIVE, [t[:-1] + "a" for t in NEGATIVE], method="caa", progress=False)
    with pytest.raises(ValueError, match="pair 1 is 'Which is it\\? \\(C' and 'Which is it! \\(D'"):
        kw.ControlVector.train(lm, POSITIVE, [t.replace("?", "!") for t in NEGATIVE], method="caa", progress=False)
    with pytest.raises(ValueError, match="method 'caa' reads the answer letter, the last token: positions must be "
                                         "'last', got -2"):
        kw.ControlVector.train(lm, POSITIVE, NEGATIVE, method="caa", positions=-2, progress=False)
    with pytest.raises(ValueError, match="positions=-10 but prompt 'Say: \\(I' has 8 tokens"):
        kw.ControlVector.train(lm, POSITIVE, NEGATIVE, method="mean_diff", positions=-10, progress=False)
    for bad in (0, 1, "first", True):
        with pytest.raises(ValueError, match=f"positions must be 'last', 'mean' or a negative token index such as "
                                             f"-2, got {bad!r}"):
            kw.ControlVector.train(lm, POSITIVE, NEGATIVE, positions=bad, progress=False)
    with pytest.raises(ValueError, match=r"site must be one of \('resid_pre', .*\), got 'mlp_in'"):
        kw.ControlVector.train(lm, POSITIVE, NEGATIVE, site="mlp_in", progress=False)
    with pytest.raises(ValueError, match="operation must be one of"):
        kw.ControlVector.train(lm, POSITIVE, NEGATIVE, operation="scale", progress=False)


def test_caa_letters_must_be_one_token_each():
    from tokenizers import Tokenizer, models

    from kvwire.io.tokenizer import Tokenizer as KvTokenizer

    lm, _ = _planted("llama")
    # "(A" is one token, "(B" two: the pair's last tokens are not the letters alone
    vocab = {"Q": 0, " ": 1, "(": 2, "A": 3, "B": 4, "(A": 5}
    lm.tokenizer = KvTokenizer(Tokenizer(models.BPE(vocab, [("(", "A")])))
    assert lm.encode("Q (A") == [0, 1, 5] and lm.encode("Q (B") == [0, 1, 2, 4]
    with pytest.raises(ValueError, match=r"method 'caa': pair 0's answer letters are not one last token each "
                                         r"\(3 and 4 tokens; prompt ...'Q \(A'\)"):
        kw.ControlVector.train(lm, ["Q (A"], ["Q (B"], method="caa", progress=False)
