"""Bad input gets a clear error that says what was received and what was expected."""
import pytest
import torch

import kvwire as kw

from .conftest import tiny_hf_gemma3, tiny_hf_gpt2


def test_unknown_model_name_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown model 'gemma9'.*\['gemma3-270m', 'smollm2-135m-instruct'\]"):
        kw.load("gemma9")


def test_a_folder_of_an_unmapped_type_transformers_cannot_load_says_so(tmp_path):
    # no native family: the generic path asks transformers, which finds no weights here
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(ValueError, match=r"model type 'mamba' has no native kvwire family, and transformers could "
                                         r"not load the folder for the generic path: "):
        kw.load(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "no_such_model"}')
    with pytest.raises(ValueError, match=r"model type 'no_such_model' has no native kvwire family"):
        kw.load(tmp_path)


def test_config_missing_sizes_names_them(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 32}')
    with pytest.raises(ValueError, match=r"llama config: missing required fields \['intermediate_size', "
                                         r"'num_attention_heads', 'num_hidden_layers', 'vocab_size'\]"):
        kw.load(tmp_path)


def test_unknown_config_field_is_not_ignored():
    from kvwire.models.gpt2 import config_from_hf

    with pytest.raises(ValueError, match=r"unknown config fields \['n_experts'\]"):
        config_from_hf({"model_type": "gpt2", "n_experts": 8})
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True is not supported"):
        config_from_hf({"scale_attn_by_inverse_layer_idx": True})


def test_gemma3_contradicting_layer_pattern_is_refused():
    from kvwire.models.gemma3 import config_from_hf

    with pytest.raises(ValueError, match="contradict sliding_window_pattern"):
        config_from_hf({"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2, "sliding_window_pattern": 2})


def test_gemma3_attention_softcap_is_refused():
    from kvwire.models.gemma3 import config_from_hf

    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0 is not part of Gemma 3"):
        config_from_hf({"attn_logit_softcapping": 50.0})


@pytest.fixture(scope="module")
def lm():
    return kw.from_hf(tiny_hf_gpt2())


def test_token_ids_outside_vocabulary(lm):
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 96\); got values in \[0, 96\]"):
        lm(torch.tensor([[0, 96]]))
    with pytest.raises(ValueError, match=r"got values in \[-1, 3\]"):
        lm.generate(torch.tensor([-1, 3]))
    with pytest.raises(TypeError, match="integer tensor"):
        lm(torch.zeros(1, 3))


def test_prompt_longer_than_max_length(lm):
    with pytest.raises(ValueError, match="prompt has 5 tokens but max_length is 5"):
        lm.generate(torch.arange(5), max_length=5)
    with pytest.raises(ValueError, match="exceeds the model's context of 128 tokens"):
        lm.generate(torch.arange(100) % 96, max_new_tokens=50)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        lm.generate(torch.arange(5), max_new_tokens=0)


def test_empty_prompt(lm):
    with pytest.raises(ValueError, match="token_ids is empty"):
        lm.generate(torch.zeros(0, dtype=torch.long))
    with pytest.raises(TypeError, match="prompt must be a str, a non-empty list of str, a token-id tensor or a list of 1-D"):
        lm.generate([])
    lm_with_text = kw.CausalLM(lm.backbone, lm.head, tokenizer=object(), config=lm.config)
    with pytest.raises(ValueError, match="prompt is empty"):
        lm_with_text.generate("")


def test_cached_graph_rejects_overflow_and_bad_inputs(lm):
    cached = lm.cached
    cache = cached.init_cache(1, 8)
    mask = torch.ones(1, 8, dtype=torch.bool)
    ids = torch.tensor([[1, 2, 3]])
    pos = torch.arange(3)[None]
    with pytest.raises(ValueError, match="chunk of 3 tokens at cache_index 6 does not fit max_length 8"):
        cached(ids, pos, 6, mask, cache)  # a full-length cache never wraps silently
    with pytest.raises(TypeError, match="token_ids must be an int64 tensor"):
        cached(ids.float(), pos, 0, mask, cache)
    with pytest.raises(ValueError, match=r"positions shape \(1, 2\) != token_ids shape \(1, 3\)"):
        cached(ids, pos[:, :2], 0, mask, cache)
    with pytest.raises(TypeError, match="attention_mask must be a bool tensor"):
        cached(ids, pos, 0, mask.long(), cache)
    with pytest.raises(ValueError, match="cache has 2 layer entries; this graph has 3"):
        cached(ids, pos, 0, mask, cache[:2])
    small = cached.init_cache(1, 4)
    with pytest.raises(ValueError, match=r"cache of 'h.0.attn' must be \(key, value\) of shape \(1, 4, 8, 8\)"):
        cached(ids, pos, 0, mask, small)


def test_with_cache_needs_one_input():
    class TwoInputs(torch.nn.Module):
        def forward(self, a, b):
            return a + b

    with pytest.raises(ValueError, match=r"one input \(token_ids\); got inputs \['a', 'b'\]"):
        kw.with_cache(TwoInputs())


def test_clone_fn_must_be_callable():
    backbone = kw.from_hf(tiny_hf_gemma3()).backbone
    with pytest.raises(TypeError, match="clone's fn must be callable, got int"):
        kw.clone(backbone, 3)
    with pytest.raises(ValueError, match="depth must be one of"):
        kw.trace(backbone, depth="neuron")


def test_untied_head_is_refused():
    from kvwire.models import gemma3

    with pytest.raises(ValueError, match="tie_word_embeddings=False is not supported"):
        gemma3.config_from_hf({"tie_word_embeddings": False})


def test_an_untied_gpt2_head_is_its_own_matrix():
    """GPT-2 with tie_word_embeddings=False (a fine-tuned or baked model) == transformers, head and all."""
    from .conftest import tiny_hf_gpt2

    hf = tiny_hf_gpt2(tie_word_embeddings=False)
    with torch.no_grad():
        hf.lm_head.weight.copy_(torch.randn_like(hf.lm_head.weight))  # not the embedding
    ids = torch.tensor([[3, 17, 42, 9]])
    lm = kw.from_hf(hf)
    assert not lm.config.tie_word_embeddings
    torch.testing.assert_close(lm(ids), hf(ids).logits.detach(), atol=1e-4, rtol=1e-4)
