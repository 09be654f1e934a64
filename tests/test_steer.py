"""Control vectors on tiny models: training, steering through the cache, batches, GGUF interop."""
import numpy as np
import pytest
import torch

import kvwire as kw
from kvwire.graph import site_calls

from .conftest import FAMILIES
from .tokenizers_for_tests import char_level

POSITIVE = ["I love this", "What a joy", "So glad now", "Great day!", "Nice work", "Yes, wonderful"]
NEGATIVE = ["I hate this", "What a pain", "So sad now", "Awful day!", "Poor work", "No, terrible"]


@pytest.fixture
def chat(family):
    lm = kw.from_hf(FAMILIES[family](vocab_size=100))
    lm.tokenizer = char_level()
    return lm


def _random_vector(lm, layers, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = lm.head.weight.shape[1]
    return kw.ControlVector({i: torch.randn(width, generator=g) * scale for i in layers})


def _rollout(lm, prompt, n):
    seq = prompt.clone()
    for _ in range(n):
        seq = torch.cat([seq, lm(seq[None])[0, -1].argmax()[None]])
    return seq[len(prompt):].tolist()


def test_steered_cached_generation_equals_uncached_rollout(chat):
    vec = _random_vector(chat, [1, 2])
    steered = chat.steer(vec, 1.5)
    prompt = torch.tensor(chat.tokenizer.encode("Steer me"))
    got = steered.generate(prompt, max_new_tokens=8, ignore_eos=True)
    assert got.tolist() == _rollout(steered, prompt, 8)
    assert got.tolist() != chat.generate(prompt, max_new_tokens=8, ignore_eos=True).tolist()


def test_strength_zero_equals_the_unedited_model(chat):
    vec = _random_vector(chat, [1, 2, 3] if len(kw.block_calls(chat.backbone)) > 3 else [1, 2])
    zero = chat.steer(vec, 0.0)
    ids = torch.tensor([chat.tokenizer.encode("Some text here")])
    torch.testing.assert_close(zero(ids), chat(ids), rtol=0, atol=0)
    prompts = ["Hello", "A longer prompt"]
    assert zero.generate(prompts, max_new_tokens=6) == chat.generate(prompts, max_new_tokens=6)


def test_per_row_strengths_in_a_batch_equal_separate_runs(chat):
    vec = _random_vector(chat, [1, 2])
    prompts = ["Hello", "A longer prompt", "Mid one"]
    strengths = torch.tensor([2.0, 0.0, -1.0])
    mixed = chat.steer(vec, strengths).generate(prompts, max_new_tokens=8, ignore_eos=True)
    separate = [chat.steer(vec, float(s)).generate(p, max_new_tokens=8, ignore_eos=True)
                for p, s in zip(prompts, strengths)]
    assert mixed == separate
    assert separate[1] == chat.generate(prompts[1], max_new_tokens=8, ignore_eos=True)
    assert len(set(separate)) > 1 or separate[0] != chat.generate(prompts[0], max_new_tokens=8, ignore_eos=True)


def test_per_row_strengths_follow_beam_expansion(chat):
    vec = _random_vector(chat, [1, 2])
    prompts = ["Hello", "A longer prompt"]
    beam = kw.BeamSearch(num_beams=3)
    mixed = chat.steer(vec, torch.tensor([2.0, 0.0])).generate(prompts, max_new_tokens=5, sampler=beam)
    assert mixed[0] == chat.steer(vec, 2.0).generate(prompts[0], max_new_tokens=5, sampler=beam)
    assert mixed[1] == chat.generate(prompts[1], max_new_tokens=5, sampler=beam)


def test_strength_is_a_runtime_input_of_the_cached_graph(chat):
    vec = _random_vector(chat, [1, 2])
    cached = chat.steer(vec, 1.0).cached
    assert list(cached.runtime_inputs) == ["steer_strength", "steer_start", "steer_end"]
    ids = torch.tensor([chat.tokenizer.encode("Hello")] * 2)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    mask = torch.ones(2, 16, dtype=torch.bool)
    run = lambda **inputs: chat.head(cached(ids, pos, 0, mask, cached.init_cache(2, 16), **inputs)[0])
    zero = run(steer_strength=torch.zeros(2))
    torch.testing.assert_close(zero, chat(ids), atol=1e-5, rtol=1e-5)
    two = run(steer_strength=torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(two[0], chat.steer(vec, 2.0)(ids[:1])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(two[1], zero[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match=r"'steer_strength' must be a torch.float32 tensor of shape \(2,\)"):
        run(steer_strength=torch.zeros(3))
    with pytest.raises(TypeError, match=r"unknown runtime inputs \['strength'\]"):
        run(strength=torch.zeros(2))


def test_generated_only_leaves_the_prompt_unsteered(chat):
    vec = _random_vector(chat, [1, 2], scale=3.0)
    prompt = torch.tensor(chat.tokenizer.encode("Steer later"))
    later = chat.steer(vec, 2.0, generated_only=True)
    plain = chat.generate_ids(prompt, max_new_tokens=6, ignore_eos=True)
    got = later.generate_ids(prompt, max_new_tokens=6, ignore_eos=True)
    # the first token comes from the unsteered prompt; what follows is steered
    assert got.tokens[0][0] == plain.tokens[0][0]
    assert abs(got.logprobs[0][0] - plain.logprobs[0][0]) < 1e-5
    everywhere = chat.steer(vec, 2.0).generate(prompt, max_new_tokens=6, ignore_eos=True).tolist()
    assert got.tokens[0] != plain.tokens[0] or got.tokens[0] != everywhere


# caa needs A/B multiple-choice pairs (tests/test_train_methods.py)
@pytest.mark.parametrize("method", [m for m in kw.steer.vector.METHODS if m != "caa"])
def test_training_is_deterministic_and_points_to_the_positive_side(chat, method):
    vec = kw.ControlVector.train(chat, POSITIVE, NEGATIVE, layers="1-2", method=method, progress=False)
    again = kw.ControlVector.train(chat, POSITIVE, NEGATIVE, layers=[1, 2], method=method, batch_size=4,
                                   progress=False)
    assert vec.layers == [1, 2]
    for i in vec.layers:
        torch.testing.assert_close(vec.directions[i], again.directions[i], atol=1e-5, rtol=1e-4)
    swapped = kw.ControlVector.train(chat, NEGATIVE, POSITIVE, layers="1-2", method=method, progress=False)
    for i in vec.layers:
        torch.testing.assert_close(swapped.directions[i], -vec.directions[i], atol=1e-5, rtol=1e-4)
    # strength 1 moves the negative prompts' states by the mean separation along the direction:
    # right after the block it steers, their mean projection is the positive prompts'
    from kvwire.steer.train import prompt_states
    name = site_calls(chat.backbone, "block_out", [2])[2]
    d = vec.directions[2]
    steered = chat.steer(kw.ControlVector({2: d}), 1.0)
    [steer_call] = steered.backbone.meta["kvwire_inserted"]  # the Steer layer after block 2
    before = prompt_states(chat, NEGATIVE, [name], progress=False)[name] @ d
    after = prompt_states(steered, NEGATIVE, [steer_call], progress=False)[steer_call] @ d
    positive = prompt_states(chat, POSITIVE, [name], progress=False)[name] @ d
    assert positive.mean() > before.mean()
    torch.testing.assert_close(after.mean(), positive.mean(), atol=1e-4, rtol=1e-4)


def test_gguf_round_trip_uses_llama_cpp_names_and_numbering(chat, tmp_path):
    from kvwire.io.gguf import GGUFFile

    vec = kw.ControlVector.train(chat, POSITIVE, NEGATIVE, progress=False)
    n_blocks = len(kw.block_calls(chat.backbone))
    assert vec.layers == list(range(1, n_blocks))
    path = tmp_path / "vec.gguf"
    vec.save(path)
    f = GGUFFile(path)
    assert f.architecture == "controlvector"
    assert f.field("controlvector.layer_count") == n_blocks - 1
    assert [name for name, *_ in f.infos] == [f"direction.{i}" for i in range(1, n_blocks)]
    loaded = kw.ControlVector.load(path)
    assert loaded.layers == vec.layers
    assert all(torch.equal(loaded.directions[i], vec.directions[i]) for i in vec.layers)


def test_model_hint_is_the_gguf_architecture_and_survives_a_round_trip(chat, family, tmp_path):
    from kvwire.io.gguf import GGUFFile
    from kvwire.models import FAMILIES as KV_FAMILIES

    vec = kw.ControlVector.train(chat, POSITIVE, NEGATIVE, layers=[1], progress=False)
    # llama.cpp's model hint: the family's GGUF architecture, "" for a family without one
    assert vec.model_hint == (KV_FAMILIES[family].gguf_architecture or "")
    vec.save(tmp_path / "vec.gguf")
    # gguf's writer leaves an empty string out: no key means ""
    assert GGUFFile(tmp_path / "vec.gguf").field("controlvector.model_hint", "") == vec.model_hint
    assert kw.ControlVector.load(tmp_path / "vec.gguf") == vec


def test_loads_a_file_written_the_way_repeng_writes_it(chat, tmp_path):
    import gguf

    width = chat.head.weight.shape[1]
    path = tmp_path / "repeng.gguf"
    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", "gemma3")
    writer.add_uint32("controlvector.layer_count", 2)
    rows = {2: np.arange(width, dtype=np.float32), 1: -np.ones(width, dtype=np.float32)}
    for layer, v in rows.items():
        writer.add_tensor(f"direction.{layer}", v)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    vec = kw.ControlVector.load(path)
    assert vec.layers == [1, 2] and vec.model_hint == "gemma3"
    assert torch.equal(vec.directions[2], torch.arange(width, dtype=torch.float32))
    # direction.N is added after block N
    steered = chat.steer(vec, 0.5)
    by_hand = chat.edit(kw.insert_after(kw.block_calls(chat.backbone)[2], kw.Steer(vec.directions[2], 0.5)))
    by_hand = by_hand.edit(kw.insert_after(kw.block_calls(chat.backbone)[1], kw.Steer(vec.directions[1], 0.5)))
    ids = torch.tensor([chat.tokenizer.encode("Check")])
    torch.testing.assert_close(steered(ids), by_hand(ids))


def test_bad_control_vector_input(chat, tmp_path):
    width = chat.head.weight.shape[1]
    n = len(kw.block_calls(chat.backbone))
    with pytest.raises(ValueError, match=f"width {width + 1} does not fit this model's hidden size {width}"):
        chat.steer(kw.ControlVector({1: torch.ones(width + 1)}), 1.0)
    with pytest.raises(ValueError, match=rf"steers blocks \[{n}\], but this model has blocks 0-{n - 1}"):
        chat.steer(kw.ControlVector({n: torch.ones(width)}), 1.0)
    with pytest.raises(ValueError, match=rf"layer indices \[{n + 5}\] are not blocks of this model: it has blocks 0-{n - 1}"):
        kw.ControlVector.train(chat, POSITIVE, NEGATIVE, layers=[1, n + 5], progress=False)
    with pytest.raises(ValueError, match="positive must be a non-empty list"):
        kw.ControlVector.train(chat, [], NEGATIVE, progress=False)
    with pytest.raises(ValueError, match="got 6 positive and 5 negative"):
        kw.ControlVector.train(chat, POSITIVE, NEGATIVE[:5], progress=False)
    with pytest.raises(ValueError, match="method must be one of"):
        kw.ControlVector.train(chat, POSITIVE, NEGATIVE, method="pca", progress=False)
    with pytest.raises(ValueError, match="block 0 cannot be saved"):
        kw.ControlVector({0: torch.ones(width)}).save(tmp_path / "zero.gguf")
    with pytest.raises(ValueError, match="steering strength has 3 rows but the batch has 2"):
        chat.steer(kw.ControlVector({1: torch.ones(width)}), torch.ones(3)).generate(["a", "b"], max_new_tokens=2)


def test_a_model_gguf_is_not_a_control_vector(tmp_path):
    from .conftest import tiny_hf_gpt2
    from .gguf_files import write_gpt2

    path = tmp_path / "model.gguf"
    write_gpt2(path, tiny_hf_gpt2(vocab_size=300))
    with pytest.raises(ValueError, match="is not a control vector: its GGUF architecture is 'gpt2'"):
        kw.ControlVector.load(path)
