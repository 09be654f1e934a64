"""SAE features per request (`kvwire serve --sae FOLDER`, `sae_features`, `sae_mode`): replies and
their log-probabilities == `steer_features` on the same tiny model; rows with different features
and modes batched == each alone; slots shared per feature, given back, 429 when full; the prefix
store keys on the features; 400s and start-up refusals naming what is wrong."""
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from kvwire.serve import create_app
from kvwire.serve.inline_sae import FeatureBank, FeatureSlots
from kvwire.steer.sae import SAE, SAEEdit, steer_features

from .serve_fixtures import Server, tiny_chat_lm
from .test_sae import FEATURES, random_sae, write_sae

HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
TOKENS = 8
SLOTS = 4


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_sae(tmp_path_factory.mktemp("sae") / "blocks.1", random_sae(jumprelu=True))


@pytest.fixture(scope="module")
def sae(folder):
    return SAE.load(folder)


@pytest.fixture(scope="module")
def server(lm, folder):
    s = Server(create_app(lm, "tiny", max_batch=4, max_length=128, inline_slots=2, sae=str(folder), sae_slots=SLOTS,
                          sae_per_request=3, playground=False))
    yield s
    s.close()


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def ask(api, **extra):
    r = api.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": TOKENS, "temperature": 0,
                                               "logprobs": True, **extra})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], [e["logprob"] for e in choice["logprobs"]["content"]]


def wire(features):
    return {str(i): list(v) if isinstance(v, tuple) else v for i, v in features.items()}


def reference(lm, model, steps):
    """Greedy decoding by `model` uncached (the whole sequence each step): each step's top log-probability."""
    ids = list(lm.tokenizer.apply_chat_template(HELLO, tokenize=True))
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logps = torch.log_softmax(model(torch.tensor([ids]))[0, -1].float(), dim=-1)
            out.append(float(logps.max()))
            ids.append(int(logps.argmax()))
    return out


CASES = [("set", {5: 6.0, 7: 0.0}), ("add", {5: 6.0, 40: -3.0}), ("clamp", {5: (None, 0.1), 9: (2.0, 3.0)}),
         ("set", {95: 4.0})]


@pytest.mark.parametrize("mode, features", CASES)
def test_features_equal_steer_features(lm, sae, api, mode, features):
    text, lps = ask(api, sae_features=wire(features), sae_mode=mode)
    model = steer_features(lm, sae, features, mode=mode)
    assert text == model.chat(HELLO, max_new_tokens=TOKENS)
    assert lps == pytest.approx(reference(lm, model, len(lps)), abs=1e-4)
    assert lps != pytest.approx(ask(api)[1], abs=1e-3)  # the edit bites: a bank that did nothing fails here


def test_the_slot_layer_equals_sae_edit_per_row(sae):
    """One FeatureSlots layer, rows setting, adding, clamping or leaving features alone == `SAEEdit`
    on each row alone; and a branch-free graph (it traces)."""
    bank = FeatureBank(tiny_chat_lm(), sae, slots=5, per_request=5)
    asks = [bank.parse({"5": 6.0, "7": 0.0}, "set"), bank.parse({"40": -3.0}, "add"),
            bank.parse({"5": [None, 0.1], "9": [2.0, 3.0]}, "clamp"), []]
    edits = [SAEEdit(sae, {5: 6.0, 7: 0.0}, "set"), SAEEdit(sae, {40: -3.0}, "add"),
             SAEEdit(sae, {5: (None, 0.1), 9: (2.0, 3.0)}, "clamp"), None]
    # freed slots keep their features' weights (slot 4 keeps feature 64's): rows not asking leave them inert
    bank.release(bank.acquire(bank.parse({str(i): 1.0 for i in range(60, 65)}, "set")))
    x = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(1)) * 2
    inputs = {k: v.clone() for k, v in bank.layer.runtime_defaults(4).items()}
    lent = []
    for row, asked in enumerate(asks):
        slots = bank.acquire(asked) if asked else []
        lent.append(slots)
        for name, value in bank.inputs(slots, asked).items():
            inputs[name][row] = value
    assert bank.held.count(None) == 1 and lent[0][0] == lent[2][0]  # feature 5 shares one slot
    out = bank.layer.forward_cached(x, positions=torch.arange(6)[None].expand(4, -1), **inputs)
    for row, edit in enumerate(edits):
        want = x[row:row + 1] if edit is None else edit(x[row:row + 1])
        assert torch.allclose(out[row:row + 1], want, atol=1e-5), row
    for slots in lent:
        bank.release(slots)
    assert bank.held == [None] * 5
    torch.fx.symbolic_trace(FeatureSlots(2, 8))  # no data-dependent Python control flow


def test_rows_with_different_features_batch_as_each_alone(lm, api, server):
    asks = [dict(sae_features={"5": 6.0}), dict(sae_features={"5": 2.0, "40": 1.0}, sae_mode="add"),
            dict(sae_features={"9": [2.0, 3.0]}, sae_mode="clamp"), {},
            dict(sae_features={"7": 3.0}, steer_vectors=[{"directions": {"2": [0.5] * 32}}])]
    alone = [ask(api, **a) for a in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda a: ask(api, **a), asks))
    for (t1, l1), (t2, l2) in zip(alone, together):
        assert t1 == t2 and l1 == pytest.approx(l2, abs=1e-4)
    assert len({tuple(round(lp, 3) for lp in lps) for _, lps in alone}) == len(asks)
    assert server.app.state.sae.held == [None] * SLOTS  # every slot given back


def test_a_feature_in_use_shares_its_slot_and_full_slots_answer_429(sae, server, api):
    bank = server.app.state.sae
    held = bank.acquire(bank.parse({"1": 1.0, "2": 1.0, "3": 1.0}, "set"))
    held += bank.acquire(bank.parse({"4": 1.0}, "add"))
    try:
        assert sorted(held) == list(range(SLOTS))
        # features 1 and 4 are held: asking for them shares their slots; feature 50 finds none free
        assert ask(api, sae_features={"1": 2.0, "4": -1.0})
        r = api.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2,
                                                   "sae_features": {"1": 2.0, "50": 1.0}})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "sae_slots_busy" and r.json()["error"]["param"] == "sae_features"
        assert [h[1] for h in bank.held] == [1] * SLOTS  # the refused request's share of slot 1 is given back
    finally:
        bank.release(held)
    assert bank.held == [None] * SLOTS
    assert ask(api, sae_features={"50": 1.0})


def test_the_prefix_store_keys_on_the_feature(lm, sae, api):
    for index in (5, 9, 5):  # the same prompt and value, the feature in the (probably) same slot changing
        text, _ = ask(api, sae_features={str(index): 5.0})
        assert text == steer_features(lm, sae, {index: 5.0}).chat(HELLO, max_new_tokens=TOKENS)


BAD = [
    ({"sae_features": {"96": 1.0}}, "sae_features has feature '96'; expected an index in [0, 96) (the SAE's d_sae "
                                    "is 96)"),
    ({"sae_features": {"-1": 1.0}}, "sae_features has feature '-1'; expected an index in [0, 96)"),
    ({"sae_features": {"x": 1.0}}, "sae_features has feature 'x'"),
    ({"sae_features": {"\u00b2": 1.0}}, "sae_features has feature"),  # a digit to isdigit, not to int
    ({"sae_features": {"1": 1.0, "2": 1.0, "3": 1.0, "4": 1.0}},
     "sae_features has 4 features; this server allows at most 3 per request"),
    ({"sae_features": {"1": 1.0, "01": 2.0}}, "sae_features names feature 1 twice"),
    ({"sae_features": {"1": 1.0}, "sae_mode": "scale"}, "sae_mode is 'scale'; expected one of ['set', 'add', 'clamp']"),
    ({"sae_features": {"1": [1.0, 2.0]}}, "sae_features.1 is [1.0, 2.0]; sae_mode 'set' takes a number"),
    ({"sae_features": {"1": 1.0}, "sae_mode": "clamp"}, "sae_features.1 is 1.0; sae_mode 'clamp' takes [lo, hi]"),
    ({"sae_features": {"1": [3.0, 2.0]}, "sae_mode": "clamp"}, "sae_features.1: lo 3.0 > hi 2.0; expected lo <= hi"),
    ({"sae_features": {"1": float("nan")}}, "sae_features.1 is nan; expected a finite float32 number"),
    ({"sae_features": {"1": [None, float("inf")]}, "sae_mode": "clamp"}, "sae_features.1[1] is inf"),
    ({"sae_features": {"1": 1e39}, "sae_mode": "add"}, "sae_features.1 is 1e+39; expected a finite float32 number"),
]


@pytest.mark.parametrize("extra, message", BAD)
def test_bad_features_are_400s_naming_what_is_wrong(api, extra, message):
    import json

    body = json.dumps({"messages": HELLO, "max_tokens": 2, **extra})  # NaN and Infinity as Python's json writes them
    r = api.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] in ("sae_features", "sae_mode"), error


def test_the_model_card_and_a_server_without_an_sae(lm, api):
    card = api.get("/v1/models/tiny").json()
    assert card["sae"] == {"d_sae": FEATURES, "site": "block_out", "layer": 1, "slots": SLOTS, "per_request": 3,
                           "modes": ["set", "add", "clamp"]}
    plain = Server(create_app(lm, "tiny", max_batch=1, max_length=64, inline_slots=0, playground=False))
    try:
        r = httpx.post(plain.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                            "sae_features": {"1": 1.0}})
        assert r.status_code == 400 and "this server has no SAE for sae_features (start it with --sae FOLDER)" in r.text
        assert httpx.get(plain.url + "/v1/models/tiny").json()["sae"] is None
    finally:
        plain.close()


def test_another_site_and_block(lm, sae):
    """--sae-site / --sae-layer: the bank edits there, == steer_features with the same site and layer."""
    app = create_app(lm, "tiny", max_batch=1, max_length=64, inline_slots=0, playground=False, sae=sae,
                     sae_site="mlp_out", sae_layer=2)
    s = Server(app)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as api:
            text, _ = ask(api, sae_features={"5": 8.0})
            bank = app.state.sae  # a server without inline slots: a full SAE bank is still a 429
            held = bank.acquire(bank.parse({str(i): 1.0 for i in range(bank.slots)}, "set"))
            r = api.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "sae_features": {"90": 1.0}})
            bank.release(held)
            assert r.status_code == 429 and r.json()["error"]["code"] == "sae_slots_busy", r.text
        assert text == steer_features(lm, sae, {5: 8.0}, layer=2, site="mlp_out").chat(HELLO, max_new_tokens=TOKENS)
        assert app.state.sae.describe()["site"] == "mlp_out"
    finally:
        s.close()


def test_bad_start_up_options_are_refused_by_name(lm, sae, tmp_path):
    narrow = SAE.load(write_sae(tmp_path / "narrow", random_sae(width=16, features=8)))
    cases = [(dict(sae=narrow), "the SAE reads vectors of width 16 (d_in) but this model's hidden size is 32"),
             (dict(sae=sae, sae_slots=0), "SAE slots (--sae-slots) must be a positive int, got 0"),
             (dict(sae=sae, sae_slots=-2), "SAE slots (--sae-slots) must be a positive int, got -2"),
             (dict(sae=sae, sae_per_request=0), "SAE features per request (--sae-per-request) must be a positive int"),
             (dict(sae=sae, sae_layer=9), "blocks [9] are not blocks of this model"),
             (dict(sae=sae, sae_site="nowhere"), "site must be one of"),
             (dict(sae=str(tmp_path / "missing")), "has no cfg.json; expected a SAELens SAE folder")]
    for options, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                           .replace("]", r"\]")):
            create_app(lm, "tiny", max_batch=1, max_length=64, playground=False, **options)


def test_the_command_line_refuses_nonsense_by_name(tmp_path, capsys):
    from kvwire.cli import main

    cases = [(["--sae", "x", "--sae-slots", "0"], "argument --sae-slots: expected a positive int, got '0'"),
             (["--sae", "x", "--sae-per-request", "-1"], "argument --sae-per-request: expected a positive"),
             (["--sae-slots", "4"], "--sae-slots need --sae FOLDER"),
             (["--sae", str(tmp_path), "--sae-site", "up"], "--sae-site must be one of"),
             (["--sae", str(tmp_path)], f"--sae {tmp_path}: {tmp_path} has no cfg.json")]
    for argv, message in cases:
        try:  # argparse's refusals exit; the command's own return 2
            code = main(["serve", "--model", str(tmp_path / "never-loaded.gguf"), *argv])
        except SystemExit as e:
            code = e.code
        assert code == 2 and message in capsys.readouterr().err, argv
