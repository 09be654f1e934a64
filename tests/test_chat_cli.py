"""`kvwire chat` (fed through stdin) and `kvwire serve` (its app run by the test's uvicorn thread)."""
import io

import pytest

import kvwire as kw
from kvwire import cli

from .serve_fixtures import CHATML, Server, backend, control_vectors, tiny_chat_hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A checkpoint folder of the tiny chat model: weights, tokenizer.json and chat_template.jinja."""
    path = tmp_path_factory.mktemp("chat_model")
    tiny_chat_hf().save_pretrained(path)
    backend().save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(CHATML)
    return path


def run_chat(monkeypatch, capsys, argv, stdin):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = cli.main(["chat", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_chat_streams_turns_resets_and_exits(folder, monkeypatch, capsys):
    lm = kw.load(folder)
    hello = [{"role": "user", "content": "Hello"}]
    r1 = lm.chat(hello, max_new_tokens=6, reuse_prefix=False)
    r2 = lm.chat(hello + [{"role": "assistant", "content": r1}, {"role": "user", "content": "More"}],
                 max_new_tokens=6, reuse_prefix=False)
    code, out, err = run_chat(monkeypatch, capsys, ["--model", str(folder), "--max-new-tokens", "6"],
                              "Hello\nMore\n/reset\n\nHello\n/exit\nnever read\n")
    assert code == 0, err
    assert out == f"{r1}\n{r2}\n{r1}\n" and "(conversation cleared)" in err
    code, out, _ = run_chat(monkeypatch, capsys, ["--model", str(folder), "--max-new-tokens", "6"], "Hello\n")
    assert code == 0 and out == f"{r1}\n"  # end of input quits


def test_chat_steered_with_a_control_vector(folder, monkeypatch, capsys, tmp_path):
    lm = kw.load(folder)
    vec = control_vectors(lm)["happy"]
    vec.save(tmp_path / "happy.gguf")
    hello = [{"role": "user", "content": "Hello"}]
    expected = lm.steer(vec, 1.5).chat(hello, max_new_tokens=6)
    assert expected != lm.chat(hello, max_new_tokens=6)
    code, out, err = run_chat(monkeypatch, capsys, ["--model", str(folder), "--max-new-tokens", "6", "--control-vector",
                                                    str(tmp_path / "happy.gguf"), "--strength", "1.5"], "Hello\n")
    assert code == 0 and out == f"{expected}\n", err


def test_chat_errors(folder, monkeypatch, capsys, tmp_path):
    plain = tmp_path / "plain"
    tiny_chat_hf().save_pretrained(plain)
    backend().save(str(plain / "tokenizer.json"))
    code, _, err = run_chat(monkeypatch, capsys, ["--model", str(plain)], "Hello\n")
    assert code == 2 and "has no chat template, so kvwire chat cannot render" in err
    code, _, err = run_chat(monkeypatch, capsys, ["--model", str(folder), "--beams", "2"], "Hello\n")
    assert code == 2 and "beam search runs through kvwire generate" in err
    # a turn past the context is refused and the chat goes on
    code, out, err = run_chat(monkeypatch, capsys, ["--model", str(folder), "--max-new-tokens", "4"],
                              "word " * 300 + "\nHello\n")
    lm = kw.load(folder)
    assert code == 0 and "but max_length is 256 (/reset starts over)" in err
    assert out.endswith(lm.chat([{"role": "user", "content": "Hello"}], max_new_tokens=4) + "\n")


def test_serve_command_builds_the_app_with_named_vectors(folder, monkeypatch, capsys, tmp_path):
    import httpx

    lm = kw.load(folder)
    for name, vec in control_vectors(lm).items():
        vec.save(tmp_path / f"{name}.gguf")
    served = []
    monkeypatch.setattr("kvwire.serve.serve", lambda app, host, port: served.append((app, host, port)))
    argv = ["serve", "--model", str(folder), "--port", "8123", "--max-batch", "2", "--max-length", "96",
            "--control-vector", f"happy={tmp_path / 'happy.gguf'}", "--control-vector", f"formal={tmp_path / 'formal.gguf'}"]
    assert cli.main(argv) == 0
    (app, host, port), = served
    assert (host, port) == ("127.0.0.1", 8123) and "serving" in capsys.readouterr().err
    server = Server(app)
    try:
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert card["id"] == str(folder) and card["control_vectors"] == ["formal", "happy"] and card["max_length"] == 96
        body = {"model": str(folder), "messages": [{"role": "user", "content": "Hello"}], "temperature": 0,
                "max_tokens": 6, "steer": {"happy": 1.5}}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body).json()
        steered = lm.steer(kw.ControlVector.load(tmp_path / "happy.gguf"), 1.5)
        assert reply["choices"][0]["message"]["content"] == steered.chat(body["messages"], max_new_tokens=6)
    finally:
        server.close()


@pytest.mark.parametrize("option, message", [
    ("happy", "expected NAME=FILE"),
    ("bad-name=x.gguf", "'bad-name' is not a Python identifier"),
    ("=x.gguf", "expected NAME=FILE"),
])
def test_serve_refuses_bad_control_vector_options_before_loading(option, message, capsys):
    assert cli.main(["serve", "--model", "/nonexistent", "--control-vector", option]) == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_a_name_given_twice(capsys):
    assert cli.main(["serve", "--model", "/nonexistent", "--control-vector", "a=x.gguf", "--control-vector",
                     "a=y.gguf"]) == 2
    assert "'a' is given twice" in capsys.readouterr().err


def test_ctrl_c_stops_a_reply_keeps_the_conversation_and_quits_cleanly_at_the_prompt(folder, monkeypatch, capsys):
    """Ctrl-C during a reply ends that reply (what was shown stays in the conversation); at the
    prompt it leaves with exit code 0 and no traceback."""
    seen = []
    real_chat = kw.CausalLM.chat

    def chat(self, messages, *args, **kwargs):
        seen.append([dict(m) for m in messages])
        pieces = real_chat(self, messages, *args, **kwargs)
        if len(seen) == 1:  # the first reply is interrupted after its first piece
            def interrupted():
                yield next(pieces)
                raise KeyboardInterrupt
            return interrupted()
        return pieces

    lines = iter(["Hello", "More"])

    def prompt(_=""):
        try:
            return next(lines)
        except StopIteration:
            raise KeyboardInterrupt from None
    monkeypatch.setattr(kw.CausalLM, "chat", chat)
    monkeypatch.setattr("builtins.input", prompt)
    code = cli.main(["chat", "--model", str(folder), "--max-new-tokens", "6"])
    err = capsys.readouterr().err
    assert code == 0 and "(reply stopped)" in err and "(bye)" in err and "Traceback" not in err
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]  # the stopped turn was kept
    assert seen[1][1]["content"] and seen[1][2]["content"] == "More"


def test_a_chat_template_file_for_a_model_without_one(folder, monkeypatch, capsys, tmp_path):
    plain = tmp_path / "plain"
    tiny_chat_hf().save_pretrained(plain)
    backend().save(str(plain / "tokenizer.json"))
    (tmp_path / "chatml.jinja").write_text(CHATML)
    hello = [{"role": "user", "content": "Hello"}]
    expected = kw.load(folder).chat(hello, max_new_tokens=6)  # the same weights with the template in the folder
    code, out, err = run_chat(monkeypatch, capsys, ["--model", str(plain), "--max-new-tokens", "6",
                                                    "--chat-template", str(tmp_path / "chatml.jinja")], "Hello\n")
    assert code == 0 and out == f"{expected}\n", err
    # another template than the model's own wins: the rendered prompt changes the reply's context
    (tmp_path / "other.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    code, out, err = run_chat(monkeypatch, capsys, ["--model", str(folder), "--max-new-tokens", "6",
                                                    "--chat-template", str(tmp_path / "other.jinja")], "Hello\n")
    lm = kw.load(folder)
    lm.tokenizer.chat_template = kw.io.chat_template.ChatTemplate("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert code == 0 and out == f"{lm.chat(hello, max_new_tokens=6)}\n", err
    assert out != f"{expected}\n"  # the model's own template gives another reply
    for name, text, says in (("missing.jinja", None, "cannot read it"), ("empty.jinja", " \n", "the file is empty"),
                             ("broken.jinja", "{% for m in %}", "the chat template does not compile")):
        if text is not None:
            (tmp_path / name).write_text(text)
        code, _, err = run_chat(monkeypatch, capsys, ["--model", str(plain), "--chat-template", str(tmp_path / name)],
                                "Hello\n")
        assert code == 2 and f"--chat-template {tmp_path / name}" in err and says in err, err


def test_serve_renders_chats_with_a_chat_template_file(folder, monkeypatch, tmp_path):
    import httpx

    plain = tmp_path / "plain"
    tiny_chat_hf().save_pretrained(plain)
    backend().save(str(plain / "tokenizer.json"))
    (tmp_path / "chatml.jinja").write_text(CHATML)
    served = []
    monkeypatch.setattr("kvwire.serve.serve", lambda app, host, port: served.append(app))
    assert cli.main(["serve", "--model", str(plain), "--max-batch", "2", "--max-length", "96",
                     "--chat-template", str(tmp_path / "chatml.jinja")]) == 0
    server = Server(served[0])
    try:
        body = {"messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "max_tokens": 6}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body).json()
        assert reply["choices"][0]["message"]["content"] == kw.load(folder).chat(body["messages"], max_new_tokens=6)
    finally:
        server.close()
