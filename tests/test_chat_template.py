"""Chat templates render exactly as transformers' apply_chat_template does (public templates written
here, and the preset GGUFs' own); errors, limits, tokenize, save/load and end-of-turn ids."""
import json
import re
import time
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

from kvwire.io.chat_template import ChatTemplate, template_from_gguf
from kvwire.io.tokenizer import CHAT_FILE, Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_folder

transformers = pytest.importorskip("transformers")

# ChatML as SmolLM2-Instruct ships it (tokenizer_config.json)
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Llama 3.2's shape: date from strftime_now, system prompt pulled out, tools as indented JSON
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions:\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}' }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Gemma 3's: the system prompt folds into the first user turn, roles must alternate, content parts
GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# no whitespace control: trim_blocks / lstrip_blocks decide the output; loopcontrols; custom variables
PLAIN = """{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    [{{ m.role }}] {{ m.content if m.content is string else m.content | tojson }}
    {% if m.content == 'stop' %}{% break %}{% endif %}
{% endfor %}
{% if shout %}LOUD{% endif %}{{ eos_token }}{{ pad_token | default('') }}
"""

SPECIALS = {"chatml": ("<|im_start|>", "<|im_end|>"), "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
            "gemma": ("<bos>", "<end_of_turn>"), "plain": ("<s>", "</s>")}
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA, "plain": PLAIN}
EXTRA = ["<start_of_turn>", "<|start_header_id|>", "<|end_header_id|>", "<|endoftext|>", "<pad>"]

SYSTEM = {"role": "system", "content": "You are terse. Réponds en français \u6771\u4eac."}
TURNS = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "  Hi, how can I help?\n"},
         {"role": "user", "content": "Say <b>\"bonjour\"</b> & more"}]
CHATS = [TURNS[:1], TURNS, [SYSTEM, *TURNS]]
PARTS = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is this? "}]}]


def backend():
    """Byte-level BPE without merges (one token per byte), so any text encodes, plus the specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Backend(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for pair in SPECIALS.values() for t in pair] + EXTRA)
    return tok


def pair(name, **extra):
    """(kvwire Tokenizer, transformers tokenizer) sharing one backend and the template `name`."""
    bos, eos = SPECIALS[name]
    b = backend()
    ours = Tokenizer(b, bos_token_id=b.token_to_id(bos), eos_token_ids=[b.token_to_id(eos)], add_bos=True,
                     chat_template=ChatTemplate(TEMPLATES[name], name), special_tokens=extra)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=b, bos_token=bos, eos_token=eos, **extra)
    theirs.chat_template = TEMPLATES[name]
    return ours, theirs


@pytest.mark.parametrize("name", ["chatml", "llama3", "gemma", "plain"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(name, chat, add_generation_prompt):
    ours, theirs = pair(name)
    messages = CHATS[chat]
    expected = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("name, variables", [
    ("llama3", {"date_string": "01 Jan 2025"}),
    ("llama3", {"tools": [{"type": "function", "function": {"name": "météo", "description": "Wetter \u2600",
                                                            "parameters": {"type": "object", "properties": {}}}}]}),
    ("plain", {"shout": True}),
])
def test_variables_reach_the_template_as_in_transformers(name, variables):
    ours, theirs = pair(name, pad_token="<pad>")
    messages = [SYSTEM, *TURNS[:1], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "météo", "arguments": {"city": "Zürich"}}}], "content": None}]
    messages = messages if "tools" in variables else CHATS[2]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)
    assert ours.apply_chat_template(messages, **variables) == expected
    assert ("LOUD" in expected) == ("shout" in variables) and ("<pad>" in expected) == (name == "plain")


LOOPED = [{"role": "skip", "content": "x"}, {"role": "user", "content": "stop"}, {"role": "user", "content": "gone"}]


@pytest.mark.parametrize("name, messages", [("gemma", PARTS), ("plain", PARTS + LOOPED)])
def test_content_parts_and_loop_controls(name, messages):
    ours, theirs = pair(name)
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert "gone" not in expected and "[skip]" not in expected


@pytest.mark.parametrize("name", ["llama3", "gemma", "chatml"])
def test_tokenize_adds_no_second_bos(name):
    ours, theirs = pair(name)
    ids = ours.apply_chat_template(CHATS[2], tokenize=True)
    assert ids == theirs.apply_chat_template(CHATS[2], add_generation_prompt=True, return_dict=False)
    if name != "chatml":  # ChatML's "BOS" is <|im_start|>, written at every turn
        assert ids[0] == ours.bos_token_id and ids.count(ours.bos_token_id) == 1
        assert ours.encode(ours.apply_chat_template(CHATS[2]))[:2] == [ours.bos_token_id] * 2  # what is avoided
    assert ours.decode(ids, skip_special_tokens=False) == ours.apply_chat_template(CHATS[2])


def test_gemma_role_order_raises_the_templates_message():
    ours, theirs = pair("gemma")
    bad = [TURNS[0], TURNS[0]]
    with pytest.raises(Exception, match="must alternate"):
        theirs.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ValueError, match=r"gemma refused the conversation: Conversation roles must alternate "
                                         r"user/assistant/user/assistant/\.\.\."):
        ours.apply_chat_template(bad)


@pytest.mark.parametrize("messages, error, match", [
    ([], ValueError, r"non-empty list .* got an empty list"),
    ("Hello", ValueError, r"non-empty list .* got str"),
    (["Hello"], TypeError, r"messages\[0\] must be a dict .* got str"),
    ([{"content": "Hi"}], ValueError, r"messages\[0\]\['role'\] must be a str; got nothing"),
    ([{"role": "user"}], ValueError, r"messages\[0\] has no 'content'"),
    ([{"role": "user", "content": 3}], ValueError, r"messages\[0\]\['content'\] must be a str or a list .* int"),
    ([{"role": "user", "content": ["hi"]}], ValueError, r"list of parts"),
    ([{"role": "user", "content": "hi", "x": object()}], TypeError, r"messages\[0\] holds a object; expected JSON"),
])
def test_bad_messages_say_what_was_expected(messages, error, match):
    ours, _ = pair("chatml")
    with pytest.raises(error, match=match):
        ours.apply_chat_template(messages)


def test_bad_variables_and_a_missing_template():
    ours, _ = pair("llama3")
    with pytest.raises(ValueError, match=r"\['range'\] are set by the renderer"):
        ours.apply_chat_template(TURNS, range=[])
    with pytest.raises(TypeError, match="tools must be a list of dicts.*got str"):
        ours.apply_chat_template(TURNS, tools="search")
    with pytest.raises(ValueError, match="this model has no chat template"):
        Tokenizer(backend()).apply_chat_template(TURNS)


def test_generation_blocks_render_as_in_transformers():
    source = "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>" \
             "{% endgeneration %}{% else %}<u>{{ m.content }}</u>{% endif %}{% endfor %}"
    _, theirs = pair("plain")
    theirs.chat_template = source
    assert ChatTemplate(source).render(TURNS) == theirs.apply_chat_template(TURNS, tokenize=False)


def test_a_broken_template_names_its_origin():
    with pytest.raises(ValueError, match=r"model\.gguf: tokenizer\.chat_template: the chat template does not compile: "
                                         r".*\(line 1\)"):
        ChatTemplate("{% for m in messages %}", "model.gguf: tokenizer.chat_template")
    with pytest.raises(ValueError, match=r"t: rendering failed: UndefinedError"):
        ChatTemplate("{{ messages[0].nope.deeper }}", "t").render(TURNS)


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}", "{{ 'x' * 100000000 }}", "{{ 9 ** 99999999 }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% for i in range(99999) %}{{ 'y' * 200 }}{% endfor %}",
])
def test_hostile_templates_fail_fast_instead_of_hanging(source):
    start = time.perf_counter()
    result = None
    try:
        result = ChatTemplate(source, "hostile").render(TURNS)
    except ValueError as e:
        assert re.match(r"hostile: rendering (stopped: |failed: SecurityError)", str(e))
    assert result in (None, "") and time.perf_counter() - start < 5


def test_save_and_load_keep_the_template(tmp_path):
    ours, _ = pair("gemma", pad_token="<pad>")
    ours.eot_token_id = ours.backend.token_to_id("<|endoftext|>")
    ours.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert again.chat_template.source == GEMMA
    assert again.apply_chat_template(CHATS[2]) == ours.apply_chat_template(CHATS[2])
    assert again.special_tokens == ours.special_tokens and again.end_of_turn_ids == ours.end_of_turn_ids
    assert set(json.loads((tmp_path / "kvwire_tokenizer.json").read_text())) == {"bos_token_id", "eos_token_ids",
                                                                                "add_bos"}  # as older kvwire reads it
    (tmp_path / CHAT_FILE).unlink()  # a folder saved before templates
    assert Tokenizer.load(tmp_path).chat_template is None


@pytest.mark.real  # converts the real SmolLM2 weights into a fresh cache (~3 s)
def test_a_cache_entry_from_before_templates_gets_its_template(tmp_path, monkeypatch):
    import kvwire as kw
    from kvwire.models.presets import PRESETS

    preset_gguf("smollm2-135m-instruct")
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    kw.load("smollm2-135m-instruct", progress=False)
    (chat_file,) = tmp_path.glob(f"*/{CHAT_FILE}")
    chat_file.unlink()  # as a cache entry written before chat templates were kept
    lm = kw.load("smollm2-135m-instruct", progress=False)
    assert lm.tokenizer.chat_template.source.startswith("{% for message in messages %}") and chat_file.is_file()


def test_end_of_turn_ids():
    ours, _ = pair("chatml")
    b = ours.backend
    ours.eos_token_ids = (b.token_to_id("<|endoftext|>"),)  # as GPT-2-style vocabularies have it
    assert ours.end_of_turn_ids == (b.token_to_id("<|endoftext|>"), b.token_to_id("<|im_end|>"))
    gemma, _ = pair("gemma")  # <|im_end|> is in the vocabulary but not in Gemma's template
    assert gemma.end_of_turn_ids == (b.token_to_id("<end_of_turn>"),)
    gemma.eot_token_id = 7
    assert gemma.end_of_turn_ids == (b.token_to_id("<end_of_turn>"), 7)
    assert Tokenizer(b, eos_token_ids=[3]).end_of_turn_ids == (3,)


def fake_gguf(**overrides):
    """A GGUF stand-in (path, field) holding a small sentencepiece vocabulary and a template."""
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "<|im_end|>", "<|eot|>",
                                                                       "\u2581", "a", "b"],
            "tokenizer.ggml.token_type": [2, 3, 3, 3, 3, 1, 1, 1], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.eot_token_id": 4,
            "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"}
    meta.update(overrides)
    return SimpleNamespace(path="fake.gguf", field=lambda key, default=None: meta.get(key, default))


def test_gguf_template_eot_and_token_strings():
    tok = tokenizer_from_gguf(fake_gguf())
    assert tok.add_bos and tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert tok.end_of_turn_ids == (2, 4, 3)  # eos, GGUF eot, <|im_end|> written by the template
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=True) == [1, 6, 7, 3]
    assert tokenizer_from_gguf(fake_gguf(**{"tokenizer.chat_template": None})).chat_template is None
    with pytest.raises(ValueError, match=r"fake\.gguf: tokenizer\.chat_template must be a string; got list"):
        tokenizer_from_gguf(fake_gguf(**{"tokenizer.chat_template": ["x"]}))
    with pytest.raises(ValueError, match=r"fake\.gguf: tokenizer\.ggml\.eot_token_id = 99 is not a token id"):
        tokenizer_from_gguf(fake_gguf(**{"tokenizer.ggml.eot_token_id": 99}))


def hf_folder(tmp_path, settings, jinja=None):
    tmp_path = tmp_path / str(len(list(tmp_path.iterdir())))  # a fresh folder per call
    tmp_path.mkdir()
    backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    b = backend()
    config = SimpleNamespace(bos_token_id=b.token_to_id("<bos>"), eos_token_id=[b.token_to_id("<end_of_turn>")])
    return tokenizer_from_hf_folder(tmp_path, config)


def test_hf_folder_templates(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": GEMMA}]
    tok = hf_folder(tmp_path, {"chat_template": named, "pad_token": {"content": "<pad>"}, "eos_token": "<eos>"})
    assert tok.chat_template.source == GEMMA and tok.special_tokens["pad_token"] == "<pad>"
    assert tok.special_tokens["eos_token"] == "<eos>"  # tokenizer_config.json's string wins, as in transformers
    assert hf_folder(tmp_path, {"chat_template": "A"}, jinja="B").chat_template.source == "B"  # v5's file wins
    assert hf_folder(tmp_path, {}).chat_template is None
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template must be a string or a list .*int"):
        hf_folder(tmp_path, {"chat_template": 3})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template names templates \['a'\] but none"):
        hf_folder(tmp_path, {"chat_template": [{"name": "a", "template": "x"}]})
    with pytest.raises(ValueError, match=r"chat_template\.jinja: the chat template does not compile"):
        hf_folder(tmp_path, {}, jinja="{% if %}")


def test_transformers_tokenizer_template_is_kept():
    from kvwire.io.chat_template import template_from_transformers

    _, theirs = pair("llama3")
    assert template_from_transformers(theirs).source == LLAMA3
    theirs.chat_template = {"default": CHATML, "tool_use": "T"}
    assert template_from_transformers(theirs).source == CHATML


def preset_gguf(name):
    from kvwire.io.gguf import GGUFFile
    from kvwire.models.presets import PRESETS

    try:
        return GGUFFile(PRESETS[name]())
    except ValueError as e:  # the package is not installed
        pytest.skip(str(e))


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_smollm2_own_template_equals_transformers(chat):
    gguf = preset_gguf("smollm2-135m-instruct")
    ours = tokenizer_from_gguf(gguf)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.backend, **ours.special_tokens)
    theirs.chat_template = gguf.field("tokenizer.chat_template")
    for prompt in (True, False):
        expected = theirs.apply_chat_template(CHATS[chat], add_generation_prompt=prompt, tokenize=False)
        assert ours.apply_chat_template(CHATS[chat], add_generation_prompt=prompt) == expected
        assert ours.apply_chat_template(CHATS[chat], add_generation_prompt=prompt, tokenize=True) == \
            theirs.apply_chat_template(CHATS[chat], add_generation_prompt=prompt, return_dict=False)
    assert ours.backend.token_to_id("<|im_end|>") in ours.end_of_turn_ids


def test_gemma3_270m_file_has_no_chat_template():
    # the preset is the base (pretrained) model: its GGUF carries no tokenizer.chat_template, so chat
    # needs a template from elsewhere; this pins that, and the error a caller gets
    gguf = preset_gguf("gemma3-270m")
    assert template_from_gguf(gguf.path, gguf.field) is None
    with pytest.raises(ValueError, match="this model has no chat template"):
        Tokenizer(backend(), chat_template=template_from_gguf(gguf.path, gguf.field)).apply_chat_template(TURNS)
