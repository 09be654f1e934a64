"""Every decoder-only causal LM type of the installed transformers through kvwire's generic path.

    python bench/generic_sweep.py [--types llama,gpt2] [--timeout 300] [--write docs/generic-models.md]

For each type of `tests/generic_configs.decoder_types()` (all of them unless `--types`): build a
tiny random model (`tiny_model`), run its own uncached forward, `kw.from_hf(generic=True)` it
(native families too), compare kvwire's logits with transformers' (float32, 1e-4 relative to their
scale), then 12 cached greedy tokens of two prompts with transformers' uncached argmax rollout
(teacher-forced where they differ: a step whose top two logits are within 1e-5 counts as
agreeing). For a type that passes, the sites found inside its blocks (`kvwire.models.generic.sites`)
are listed with whether a vector added at each, at block 1, keeps cached greedy == the steered
model's own uncached rollout. Each type runs in a forked process, so one that crashes, runs out of memory or hangs
past `--timeout` costs its own row only. Prints a table (type | result | reason); `--write` also
writes the docs page: counts, the reasons grouped by kind, and every type's row.
"""
import argparse
import copy
import os
import re
import sys
import traceback
import warnings
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PASS, PARTLY, RERUN, REFUSED, HF_FAILS, CONFIG_FAILS, WRONG, ERROR, DIED = (
    "pass", "pass, partly rerunning", "pass, rerunning", "refused by kvwire", "transformers' own forward fails",
    "no tiny config", "differs", "kvwire error", "no answer")
ORDER = (PASS, PARTLY, RERUN, REFUSED, WRONG, ERROR, DIED, HF_FAILS, CONFIG_FAILS)
STEPS = 12
TOLERANCE = 1e-4


def check(model_type):
    """(result, reason) of one type."""
    import torch

    import kvwire as kw
    from tests.generic_configs import greedy_disagreements, hf_logits, prompt, tiny_model

    try:
        hf = tiny_model(model_type)
    except Exception as e:  # noqa: BLE001 - every failure is a row of the table
        return CONFIG_FAILS, _one_line(e)
    ids = prompt(2, 9, seed=1)
    try:
        want = hf_logits(hf, ids)
    except Exception as e:  # noqa: BLE001
        return HF_FAILS, f"transformers' own forward fails: {_one_line(e)}"
    reference = copy.deepcopy(hf)  # kw.from_hf sets the model's attention implementation to kvwire's
    try:
        lm = kw.from_hf(hf, generic=True)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, ValueError) and "/kvwire/" in traceback.extract_tb(e.__traceback__)[-1].filename:
            return REFUSED, _one_line(e)  # kvwire's own refusal, saying what does not fit
        return ERROR, f"kw.from_hf: {_where(e)}"
    try:
        with torch.no_grad():
            got = lm(ids)
        diff = (got - want).abs().max().item()
        if not diff <= TOLERANCE * max(1.0, want.abs().max().item()):
            return WRONG, f"logits differ from transformers' by up to {diff:.3g} (largest logit {want.abs().max():.3g})"
        tokens = torch.stack(lm.generate(ids, max_new_tokens=STEPS, ignore_eos=True))
    except Exception as e:  # noqa: BLE001
        return ERROR, _where(e)
    bad = greedy_disagreements(lambda x: hf_logits(reference, x), ids, tokens)
    if bad:
        row, step, chosen, best, gap = bad[0]
        return WRONG, (f"cached greedy differs from the uncached rollout at {len(bad)} of {tokens.numel()} steps "
                       f"(first: row {row} step {step}, {chosen} where transformers picks {best}, {gap:.3g} below)")
    if lm.backbone.rerun_reason is not None:  # no cache the pass finds: (some of) its layers rerun over their inputs
        partly = len(lm.backbone.rerun_layers) < len(lm.backbone.layers)
        return PARTLY if partly else RERUN, f"{_one_line(ValueError(lm.backbone.rerun_reason))}; {_sites(lm, ids)}"
    return PASS, _sites(lm, ids)


def _sites(lm, ids):
    """'sites: ...' inside the blocks (those of every block), each checked steered: cached greedy ==
    the steered model's own uncached argmax rollout ('site (differs)' where not)."""
    import torch

    import kvwire as kw
    from tests.generic_configs import greedy_disagreements

    found = [s for s in lm.backbone.layers[0].inner_sites if all(s in b.inner_sites for b in lm.backbone.layers)]
    said = []
    for site in found:
        block = lm.backbone.layers[min(1, len(lm.backbone.layers) - 1)]
        width = block.site_width(site)
        v = torch.randn(width, generator=torch.Generator().manual_seed(0))
        steered = lm.steer(kw.ControlVector({block.index: v}, site=site), 4.0)
        try:
            tokens = torch.stack(steered.generate(ids, max_new_tokens=6, ignore_eos=True))
            bad = greedy_disagreements(lambda x: steered(x), ids, tokens)
        except Exception as e:  # noqa: BLE001
            bad = [_one_line(e)]
        said.append(site if not bad else f"{site} (differs)")
    return "sites: " + ", ".join(said + ["block_out"])


def _one_line(e):
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:500]}"


def _where(e):
    """The exception and the innermost frame of the library code that raised it."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages" in f.filename
              or "/kvwire/" in f.filename]
    at = ""
    if frames:
        f = frames[-1]
        path = f.filename.split("site-packages/")[-1].split(ROOT + "/")[-1]
        at = f" (at {path}:{f.lineno})"
    return _one_line(e) + at


def isolated(model_type, timeout):
    """check(model_type) in a forked process, so that a type that crashes, exhausts memory or hangs
    costs its own row only."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_child, args=(model_type, send))
    worker.start()
    send.close()
    timed_out = not receive.poll(timeout)
    try:
        answer = None if timed_out else receive.recv()
    except EOFError:  # it died before answering
        answer = None
    worker.join(5)
    if worker.is_alive():
        worker.kill()
        worker.join()
    if answer is None:
        code = worker.exitcode
        why = (f"no answer within {timeout:g} s" if timed_out else
               f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}")
        return DIED, f"the check's process died ({why})"
    return answer


def _child(model_type, send):
    try:
        send.send(check(model_type))
    except BaseException as e:  # noqa: BLE001
        send.send((ERROR, _where(e)))
    send.close()


def sweep(types, timeout):
    rows = []
    for model_type in types:
        result, reason = isolated(model_type, timeout)
        rows.append((model_type, result, reason))
        print(f"{model_type:28} {result:32} {reason}", flush=True)
    return rows


def page(rows, version):
    from tests.generic_configs import EXCLUDED

    counts = Counter(result for _, result, _ in rows)
    lines = [
        "# Generic models",
        "",
        "kvwire runs a transformers causal LM whose `model_type` has no native family through the",
        "[generic path](models.md): `kw.from_hf(model)` builds a kvwire layer graph from the model's own",
        "modules and caches it through an attention function registered with transformers'",
        "`AttentionInterface` (layers computing attention themselves over what transformers' Cache",
        "API returns them, such as ALiBi models, through a cache object of kvwire's instead:",
        "`kvwire.models.generic.timeline`); layers whose mixer keeps recurrent, convolution or linear-attention",
        "state in transformers' Cache API (Mamba, short convolutions, gated delta-nets) hold a state",
        "slot of kvwire's cache instead, handed to them as a transformers `Cache` of views of it",
        "(`kvwire.models.generic.state`), or, where the mixer keeps it in attributes of its own modules",
        "(RecurrentGemma) or in a cache class of the model's own (MiniMax), set from that slot for each",
        "call (`kvwire.models.generic.held`, `kvwire.models.generic.owned`). This page is",
        "what `python bench/generic_sweep.py --write",
        "docs/generic-models.md` finds for every decoder-only causal LM type of transformers",
        f"{version}: a tiny random model of each (`tests/generic_configs.py`), its logits against",
        "transformers' (float32, within 1e-4 of their scale) and 12 cached greedy tokens against",
        "transformers' uncached argmax rollout. A type marked \"pass, rerunning\" passes the same checks",
        "without a key/value cache: the cache pass did not fit it (the reason is given), so each decoder",
        "layer keeps its inputs and reruns over each row's history every step (exact, but a decode step",
        "costs a prefill of the history: `kvwire.models.generic.rerun`); one marked \"pass, partly",
        "rerunning\" reruns only the layers the reason names, the others keeping their caches.",
        "Encoder-decoder types and encoders whose causal-LM",
        "head runs them as decoders (BERT, RoBERTa, ...) are not listed, nor these:",
        "",
        *[f"- `{t}`: {why}" for t, why in sorted(EXCLUDED.items())],
        "",
        "| result | types |",
        "|---|---:|",
        f"| tried | {len(rows)} |",
    ]
    lines += [f"| {what} | {counts[what]} |" for what in ORDER if counts[what]]
    groups = {}
    for model_type, result, reason in rows:
        if result != PASS:
            groups.setdefault((result, _kind(reason)), []).append(model_type)
    lines += ["", "What keeps the others out, by kind (type names and sizes left out of the reasons):", "",
              "| result | reason | types |", "|---|---|---|"]
    for (result, kind), types in sorted(groups.items(), key=lambda g: (ORDER.index(g[0][0]), -len(g[1]), g[0][1])):
        lines.append(f"| {result} | {kind.replace('|', '/')} | {', '.join(f'`{t}`' for t in sorted(types))} |")
    sited = [r for r in rows if r[1] in (PASS, PARTLY, RERUN)]
    full = sum("attn_out" in r[2] and "resid_mid" in r[2] and "mlp_out" in r[2] and "attn_heads" in r[2]
               and "differs" not in r[2] for r in sited)
    lines += ["", f"Sites inside the blocks of the {len(sited)} that pass (steering, `kvwire.models.generic.sites`): "
              f"{full} have all six (resid_pre, attn_out, resid_mid, mlp_out, attn_heads, block_out); the others "
              f"list theirs below. A site marked \"differs\" failed the steered check (a vector added there at "
              f"block 1: cached greedy against the steered model's own uncached rollout)."]
    lines += ["", "Every type:", "", "| type | result | reason |", "|---|---|---|"]
    for what in ORDER:
        for model_type, result, reason in sorted(r for r in rows if r[1] == what):
            lines.append(f"| `{model_type}` | {result} | {reason.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _kind(reason):
    """A reason without the class and module names and numbers that differ between types."""
    kind = re.sub(r"^(transformers' own forward fails: )?(kw\.from_hf: )?\w+: ", r"\1", reason)
    kind = re.sub(r"^\w+(ForCausalLM|LMHeadModel|ForConditionalGeneration|WithLMHead)\w*: ", "", kind)
    kind = re.sub(r"\((?:at )?[\w/.]+\.py:\d+\)", "", kind)  # where it was raised
    kind = re.sub(r"; sites: .*$", "", kind)  # a rerunning type's sites, listed in its own row
    kind = re.sub(r"\b\w+Attention\b", "its attention", kind)
    kind = re.sub(r"\(\w+\)", "(...)", kind)
    kind = re.sub(r"\d+(\.\d+)?", "N", kind)
    return kind.strip()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=None, help="comma-separated model types (default: all decoder types)")
    p.add_argument("--timeout", type=float, default=300, help="seconds one type may take (default 300)")
    p.add_argument("--write", default=None, metavar="PATH", help="write the docs page to PATH")
    args = p.parse_args(argv)
    import torch
    import transformers

    from tests.generic_configs import decoder_types

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    types = args.types.split(",") if args.types else decoder_types()
    rows = sweep(types, args.timeout)
    counts = Counter(result for _, result, _ in rows)
    print(f"\n{len(rows)} types: " + ", ".join(f"{counts[w]} {w}" for w in ORDER if counts[w]))
    if args.write:
        with open(args.write, "w") as f:
            f.write(page(rows, transformers.__version__))
    return rows


if __name__ == "__main__":
    main()
